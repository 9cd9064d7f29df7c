"""HTTP front ends over the service: the PyTRIO control and actor planes, checkpoint downloads."""

from .app import ServerHandle, create_app, start_server

__all__ = ["ServerHandle", "create_app", "start_server"]
