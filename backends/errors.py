"""The errors a backend raises to its callers (kept apart so that every backend, and the
registry that makes them, can import them without importing each other)."""


class BackendUnavailableError(ValueError):
    """A backend this machine cannot run (no CUDA driver or GPU). A ValueError with a one-line
    message, so callers (the scheduler, Engine, the `ggraph` commands) report it as a user
    error rather than a traceback."""
