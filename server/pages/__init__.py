"""The dashboard: server-rendered pages with Plotly charts, each with a JSON twin.

`router` holds every page route, the login form and the static files (assets.py).
"""

from ampwatch.server.pages.assets import redoc_js
from ampwatch.server.pages.rendering import warm_up
from ampwatch.server.pages.routes import invalid_page, router, wants_page

__all__ = ["invalid_page", "redoc_js", "router", "wants_page", "warm_up"]
