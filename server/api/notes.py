"""People's notes on a run and on its incidents, and incidents marked handled: what a
person on call writes down at 3 a.m. (`ampwatch` pages show them on the run page)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.queries import list_incidents
from ampwatch.server.api.error_responses import NOT_FOUND, READ, WRITE
from ampwatch.server.api.runs import RunIdPath
from ampwatch.server.deps import SessionDep
from ampwatch.server.errors import InvalidInput, NotFound
from ampwatch.server.models import RunNote, as_utc
from ampwatch.server.runs import get_run

router = APIRouter(prefix="/runs", tags=["notes"])
MAX_NOTE_CHARS = 4000
NoteId = Annotated[int, Path(ge=1, le=2**31 - 1)]


class NoteCreate(BaseModel):
    """`incident`: the id of one of the run's incidents the note is on (none: the run);
    `handled`: the note marks that incident handled."""

    text: str = Field("", max_length=MAX_NOTE_CHARS)
    incident: int | None = Field(None, ge=1, le=2**31 - 1)
    handled: bool = False


class NotePublic(BaseModel):
    id: int
    run_id: str
    incident: int | None
    handled: bool
    text: str
    created_at: datetime


class NotesPublic(BaseModel):
    items: list[NotePublic]


def public_note(note: RunNote) -> NotePublic:
    return NotePublic(id=note.id, run_id=note.run_id, incident=note.incident,
                      handled=note.handled, text=note.text, created_at=as_utc(note.created_at))


def run_notes(session: Session, run_id: str) -> list[NotePublic]:
    """A run's notes, oldest first."""
    rows = session.scalars(select(RunNote).where(RunNote.run_id == run_id)
                           .order_by(RunNote.id))
    return [public_note(row) for row in rows]


def add_note(session: Session, run_id: str, body: NoteCreate) -> NotePublic:
    """Store a note; an incident it names must be one of the run's."""
    get_run(session, run_id)
    text = body.text.strip()
    if body.handled and body.incident is None:
        raise InvalidInput("handled needs the incident it marks")
    if not text and not body.handled:
        raise InvalidInput("a note needs text")
    if body.incident is not None and body.incident not in {
            i.id for i in list_incidents(session, run_id).items}:
        raise NotFound(f"run {run_id!r} has no incident {body.incident}")
    note = RunNote(run_id=run_id, incident=body.incident, handled=body.handled, text=text)
    session.add(note)
    session.commit()
    return public_note(note)


@router.get("/{run_id}/notes", response_model=NotesPublic, responses=READ | NOT_FOUND,
            operation_id="list_run_notes")
def get_run_notes(run_id: RunIdPath, session: SessionDep) -> NotesPublic:
    """The run's notes and its incidents' (`handled`: the note marks its incident
    handled), oldest first."""
    get_run(session, run_id)
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
    note = session.get(RunNote, note_id)
    if note is None or note.run_id != run_id:
        raise NotFound(f"run {run_id!r} has no note {note_id}")
    session.delete(note)
    session.commit()
    return Response(status_code=204)
