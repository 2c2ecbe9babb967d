"""FastAPI dependencies as `Annotated` aliases, for the API and the pages alike: the
session, the settings, auth, and the path parameters every run route shares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.params import Depends as Dependency
from fastapi.security import APIKeyCookie, HTTPBearer
from sqlalchemy.orm import Session

from ampwatch.server.http.guards import token_scheme
from ampwatch.server.http.middleware import UNSAFE_METHODS
from ampwatch.server.settings import Settings
from ampwatch.wire import LABEL_MAX_CHARS, LABEL_PATTERN, RUN_ID_PATTERN


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
RunIdPath = Annotated[str, Path(pattern=RUN_ID_PATTERN, description="the run's id")]
NoteId = Annotated[int, Path(ge=1, le=2**31 - 1)]
ProjectPath = Annotated[str, Path(min_length=1, max_length=LABEL_MAX_CHARS,
                                  pattern=LABEL_PATTERN, description="the project's name")]


def require_token(request: Request, settings: SettingsDep) -> None:
    """401 unless AMPWATCH_TOKEN is unset or the request carries it (constant-time check).

    Accepted as `Authorization: Bearer <token>`, or as the `ampwatch_token` cookie that
    the dashboard's login form sets for browsers. A write authenticated by the cookie must
    carry an Origin header (browsers send it; `SiteGuardMiddleware` refuses another
    site's): a cookie alone never authorises a write (CSRF). (`AdmissionMiddleware` has
    already answered API requests without the token; pages get here.)
    """
    if settings.token is None:
        return
    scheme = token_scheme(request.headers, request.cookies, settings.token)
    if scheme is None:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong token: send 'Authorization: Bearer <AMPWATCH_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if (scheme == "cookie" and request.method in UNSAFE_METHODS
            and "origin" not in request.headers):
        raise HTTPException(status_code=403, detail="a write authenticated by the login "
                            "cookie must carry an Origin header; scripts send "
                            "'Authorization: Bearer <AMPWATCH_TOKEN>'")


# How the OpenAPI schema states the token (`require_token` checks it): either scheme will
# do. Neither raises; they only describe.
BEARER = HTTPBearer(auto_error=False, description="AMPWATCH_TOKEN")
LOGIN_COOKIE = APIKeyCookie(name="ampwatch_token", auto_error=False,
                            description="set by the dashboard's login form; a write "
                            "authorised by it alone must carry an Origin header")


def token_dependencies(settings: Settings) -> list[Dependency]:
    """The dependencies of every API route but /health: the token check, and when a
    token is set, the schemes that put it in the OpenAPI schema (a server without one
    documents no security, as it asks for none)."""
    if settings.token is None:
        return [Depends(require_token)]
    return [Depends(require_token), Security(BEARER), Security(LOGIN_COOKIE)]
