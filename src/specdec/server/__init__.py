"""``specdec serve``: an OpenAI-compatible HTTP server over one loaded model pair.

:func:`~specdec.server.app.create_app` builds the application (FastAPI, run by uvicorn); the
command line is in :mod:`specdec.cli.serve`. Importing this package imports no web framework:
the submodules do.
"""
