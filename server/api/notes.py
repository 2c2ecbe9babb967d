"""People's notes on a run and on its incidents, and incidents marked handled: what a
person on call writes down at 3 a.m. (`ampwatch` pages show them on the run page)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ampwatch.server.api.error_responses import NOT_FOUND, READ, WRITE
from ampwatch.server.budget import BYTES_PER_NOTE
from ampwatch.server.deps import NoteId, RunIdPath, SessionDep
from ampwatch.server.schemas.notes import NoteCreate, NotePublic, NotesPublic
from ampwatch.server.services.notes import add_note, delete_note, note_count, run_notes
from ampwatch.server.services.runs import get_run

router = APIRouter(prefix="/runs", tags=["notes"])


@router.get("/{run_id}/notes", response_model=NotesPublic, responses=READ | NOT_FOUND,
            operation_id="list_run_notes")
def get_run_notes(run_id: RunIdPath, session: SessionDep, request: Request) -> NotesPublic:
    """The run's notes and its incidents' (`handled`: the note marks its incident
    handled), oldest first; at most MAX_NOTES_PER_RUN."""
    get_run(session, run_id)
    with request.app.state.read_budget.hold(note_count(session, run_id) * BYTES_PER_NOTE):
        return NotesPublic(items=run_notes(session, run_id))


@router.post("/{run_id}/notes", status_code=201, response_model=NotePublic,
             responses=WRITE | NOT_FOUND, operation_id="add_run_note")
def post_run_note(run_id: RunIdPath, body: NoteCreate, session: SessionDep) -> NotePublic:
    """A note on the run, or on one of its incidents (`incident`); `handled: true` marks
    that incident handled (delete the note to unmark it)."""
    return add_note(session, run_id, body)


@router.delete("/{run_id}/notes/{note_id}", status_code=204, response_class=Response,
               responses=WRITE | NOT_FOUND, operation_id="delete_run_note")
def delete_run_note(run_id: RunIdPath, note_id: NoteId, session: SessionDep) -> Response:
    """Delete a note (one that marked an incident handled: the incident is open again)."""
    delete_note(session, run_id, note_id)
    return Response(status_code=204)
