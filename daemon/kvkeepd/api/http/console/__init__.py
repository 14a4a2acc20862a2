"""The web console on the HTTP door (`GET /`, `--console on|read-only|off`): a tenant's
sessions, each one's tree of checkpoints and forks, its stored responses, a chat pane and the
daemon at a glance, in a browser.

The page is a few static files shipped in the package (`static/`): HTML, CSS and plain ES
modules that draw the trees as SVG. No framework, no build step and no CDN, because the
console must work on a machine with no network beyond the daemon, be read and checked as
shipped (what the wheel holds is what runs), and stay small: it lists, draws and posts, and
a framework's state machinery and toolchain would outweigh it. Model output and labels are
only ever set as text (`textContent`), never parsed as HTML.

The page keeps its list fresh by polling `GET /console/api/sessions` every 3 seconds, not
by a stream of server-sent events. The SessionManager has no change notice to stream: a
session's tokens, tier and last use change inside its flows, its residency and its expiry,
so an event route would poll the same listing on the daemon's side and only move the timer
there. Meanwhile each open page would hold a request in the door's bound on requests served
at once, a connection in its bound per peer and one of the six a browser opens to a host,
and would keep a graceful stop waiting out its grace period. A poll is one small read, and
the same route any client with a token can call.

<!-- generated: modules -->
- routes.py: The console's routes on the HTTP door: its page and files at `/` and `/console/`,
  and the JSON routes under `/console/api/` that the page (or any client with a token) calls.
- shapes.py: The console's JSON bodies: sessions, their trees, stored responses and the daemon
  at a glance, built from what the SessionManager reports (plain dicts, as JSONResponse writes
  them).
<!-- end -->
"""
