"""pdserve's HTTP front door: the OpenAI-compatible API, routing policies, streaming, metrics.

`create_app(RouterConfig)` builds the FastAPI app; `python -m router` serves it. See README.md.
"""
from router.config import RouterConfig

__all__ = ["RouterConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from router.app import create_app
        return create_app
    raise AttributeError(f"module 'router' has no attribute {name!r}")
