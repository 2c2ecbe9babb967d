"""Notes on a run and on its incidents, and incidents marked handled, through the API
(issue #50), on the real app: kept, listed, refused when they name nothing, gone with
their run."""

from __future__ import annotations

from tests.utils import WAIT, make_steps, post_batch, register_run


def test_notes_and_handled_incidents_are_kept(api) -> None:
    register_run(api, "noted", n_layers=3)
    assert post_batch(api, "noted", 0, make_steps(0, 40, 3, skipped={7})).status_code == 200
    incidents = api.get("/api/v1/runs/noted/incidents", params=WAIT).json()["items"]
    assert incidents  # the skipped step's non-finite grads are one
    incident = incidents[0]["id"]

    note = api.post("/api/v1/runs/noted/notes", json={"text": "  restarted at 12:00 "})
    assert note.status_code == 201, note.text
    assert (note.json()["text"], note.json()["incident"]) == ("restarted at 12:00", None)
    handled = api.post("/api/v1/runs/noted/notes",
                       json={"incident": incident, "handled": True, "text": "bad batch"})
    assert handled.status_code == 201, handled.text
    listed = api.get("/api/v1/runs/noted/notes").json()["items"]
    assert [(n["text"], n["incident"], n["handled"]) for n in listed] == [
        ("restarted at 12:00", None, False), ("bad batch", incident, True)]

    assert "handled" in api.get("/runs/noted").text  # the run page says so on its card
    assert api.delete(f"/api/v1/runs/noted/notes/{handled.json()['id']}").status_code == 204
    assert [n["text"] for n in api.get("/api/v1/runs/noted/notes").json()["items"]] == [
        "restarted at 12:00"]

    refused = {"no text": {"text": " "}, "handled without incident": {"handled": True},
               "no such incident": {"incident": 999_999, "text": "x"}}
    codes = {why: api.post("/api/v1/runs/noted/notes", json=body).status_code
             for why, body in refused.items()}
    assert codes == {"no text": 422, "handled without incident": 422, "no such incident": 404}
    assert api.post("/api/v1/runs/nobody/notes", json={"text": "x"}).status_code == 404
    assert api.delete("/api/v1/runs/noted/notes/999").status_code == 404
    assert api.delete("/api/v1/runs/noted").status_code == 204
    assert api.get("/api/v1/runs/noted/notes").status_code == 404


def test_a_run_holds_at_most_its_limit_of_notes(api, monkeypatch) -> None:
    """Past MAX_NOTES_PER_RUN: 413 and nothing stored; a note over 4,000 characters 422."""
    monkeypatch.setattr("ampwatch.server.services.notes.MAX_NOTES_PER_RUN", 3)
    register_run(api, "many-notes")
    for i in range(3):
        assert api.post("/api/v1/runs/many-notes/notes", json={"text": f"n{i}"}).status_code == 201
    assert api.post("/api/v1/runs/many-notes/notes", json={"text": "n3"}).status_code == 413
    assert api.post("/api/v1/runs/many-notes/notes", json={"text": "x" * 4001}
                    ).status_code == 422
    assert len(api.get("/api/v1/runs/many-notes/notes").json()["items"]) == 3


def test_the_note_forms_incident_is_an_ascii_integer(api) -> None:
    """The run page's form: `²` and 5,000 digits passed isdigit() and broke int() (500);
    now 422 and nothing stored."""
    register_run(api, "form-notes")
    for incident in ("²", "9" * 5000, "-1", "1 ", "0x1", "99999999999"):
        answer = api.post("/runs/form-notes/notes", data={"text": "x", "incident": incident},
                          follow_redirects=False)
        assert answer.status_code == 422, (incident[:10], answer.status_code)
    assert api.get("/api/v1/runs/form-notes/notes").json()["items"] == []
    answer = api.post("/runs/form-notes/notes", data={"text": "kept"}, follow_redirects=False)
    assert answer.status_code == 303
