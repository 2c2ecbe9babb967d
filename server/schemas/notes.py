"""People's notes on a run and on its incidents, as written and as answered."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

MAX_NOTE_CHARS = 4000
MAX_NOTES_PER_RUN = 1_000  # a run's notes list answers at most 4 MB of text


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
