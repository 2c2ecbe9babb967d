"""Browser login for the pages when AMPWATCH_TOKEN is set: a form that stores the token
in the `ampwatch_token` cookie (HttpOnly, SameSite=Strict), which `require_token`
accepts on every route; pages without it redirect to the form."""

from __future__ import annotations

import hmac
from typing import Annotated
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ampwatch.server.deps import SettingsDep, require_token
from ampwatch.server.pages.rendering import render_page

COOKIE = "ampwatch_token"
COOKIE_MAX_AGE = 30 * 24 * 3600
MAX_FORM_BYTES = 8192

router = APIRouter(include_in_schema=False)


def safe_next(target: str | None) -> str:
    """Only a path on this server: never an absolute or protocol-relative URL."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def require_login(request: Request, settings: SettingsDep) -> None:
    """Pages: like `require_token`, but a browser without the token is sent to /login."""
    try:
        require_token(request, settings)
    except HTTPException:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(status_code=303, detail="login required",
                            headers={"Location": f"/login?next={quote(target, safe='')}"}
                            ) from None


PageLogin = Annotated[None, Depends(require_login)]


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request,
               target: Annotated[str | None, Query(alias="next")] = None) -> HTMLResponse:
    return render_page(request, "login.html", next=safe_next(target), error=None)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, settings: SettingsDep) -> Response:
    """Check the submitted token; on success set the cookie and go to `next`."""
    body = await request.body()
    fields = parse_qs(body[:MAX_FORM_BYTES].decode("utf-8", "replace"))
    supplied = fields.get("token", [""])[0].strip()
    target = safe_next(fields.get("next", ["/"])[0])
    expected = settings.token.get_secret_value() if settings.token else None
    if expected is not None and not hmac.compare_digest(supplied.encode(), expected.encode()):
        return render_page(request, "login.html", status_code=401, next=target,
                           error="That token is not the server's AMPWATCH_TOKEN.")
    response = RedirectResponse(target, status_code=303)
    if expected is not None:
        response.set_cookie(COOKIE, supplied, max_age=COOKIE_MAX_AGE, httponly=True,
                            samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


@router.post("/logout")
def logout() -> RedirectResponse:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response
