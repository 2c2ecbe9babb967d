"""The ampwatch server: FastAPI app, storage, analysis and pages. Never imports torch."""

__version__ = "0.1.0"


def create_app(settings=None):
    """Build the app (see server.app.create_app); imported lazily to keep this light."""
    from ampwatch.server.app import create_app as _create_app

    return _create_app(settings)
