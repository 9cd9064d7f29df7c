"""The web console: runs, loss curves, checkpoints, cost by phase and server stats in a browser.

`router` (mounted by `server.app.create_app`) serves the pages at `/console` and their JSON at
`/console/api`; see `routes`. Assets ship in `static/` (Chart.js 4 vendored with its licence).
"""

from .routes import router

__all__ = ["router"]
