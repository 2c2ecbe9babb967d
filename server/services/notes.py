"""People's notes on a run and on its incidents, and incidents marked handled: the API
(server/api/notes.py) and the run page (server/pages/routes.py) both write and read them
here."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.errors import InvalidInput, NotFound, TooMany
from ampwatch.server.findings.queries import list_incidents
from ampwatch.server.findings.store import refresh_run_health
from ampwatch.server.models import RunNote, as_utc
from ampwatch.server.schemas.notes import MAX_NOTES_PER_RUN, NoteCreate, NotePublic
from ampwatch.server.services.runs import get_run


def public_note(note: RunNote) -> NotePublic:
    return NotePublic(id=note.id, run_id=note.run_id, incident=note.incident,
                      handled=note.handled, text=note.text, created_at=as_utc(note.created_at))


def run_notes(session: Session, run_id: str) -> list[NotePublic]:
    """A run's notes, oldest first."""
    rows = session.scalars(select(RunNote).where(RunNote.run_id == run_id)
                           .order_by(RunNote.id))
    return [public_note(row) for row in rows]


def note_count(session: Session, run_id: str) -> int:
    return int(session.scalar(select(func.count()).where(RunNote.run_id == run_id)) or 0)


def add_note(session: Session, run_id: str, body: NoteCreate) -> NotePublic:
    """Store a note; an incident it names must be one of the run's. A `handled` note
    recounts the run's health: the incident no longer counts as open."""
    get_run(session, run_id)
    text = body.text.strip()
    if body.handled and body.incident is None:
        raise InvalidInput("handled needs the incident it marks")
    if not text and not body.handled:
        raise InvalidInput("a note needs text")
    if body.incident is not None and body.incident not in {
            i.id for i in list_incidents(session, run_id).items}:
        raise NotFound(f"run {run_id!r} has no incident {body.incident}")
    if note_count(session, run_id) >= MAX_NOTES_PER_RUN:
        raise TooMany(f"run {run_id!r} holds the most notes a run may, {MAX_NOTES_PER_RUN}: "
                      "delete some first")
    note = RunNote(run_id=run_id, incident=body.incident, handled=body.handled, text=text)
    session.add(note)
    if body.handled:
        session.flush()
        refresh_run_health(session, get_run(session, run_id))
    session.commit()
    return public_note(note)


def delete_note(session: Session, run_id: str, note_id: int) -> None:
    """Delete a note (one that marked an incident handled: the incident is open again)."""
    note = session.get(RunNote, note_id)
    if note is None or note.run_id != run_id:
        raise NotFound(f"run {run_id!r} has no note {note_id}")
    session.delete(note)
    if note.handled:
        session.flush()
        refresh_run_health(session, get_run(session, run_id))
    session.commit()
