"""The server's listening sockets, bound before the checkpoint loads: a port in use or a host that does not
resolve is one line and exit status 2 at once (rather than uvicorn's ERROR among its INFO lines and exit 3,
after the model loaded), and nobody can take the port while the model loads.

The sockets are bound as asyncio's ``create_server(host=..., port=...)`` (what ``uvicorn.run`` calls) binds
them: every address ``host`` resolves to, each with ``SO_REUSEADDR``, IPv6 ones IPv6-only; an address family
the machine lacks is skipped. They listen once uvicorn serves on them, so connections made while the model
loads are refused, as before."""

from __future__ import annotations

import errno
import socket

from rdepth.errors import RdepthError


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port``; :class:`RdepthError` naming the host or port."""
    try:
        infos = socket.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RdepthError(f"serve: --host {host!r} does not resolve to an address ({exc.strerror})") from None
    except UnicodeError:  # a host name IDNA cannot encode (a label over 63 characters)
        raise RdepthError(f"serve: --host {host!r} is not a valid host name") from None
    sockets: list[socket.socket] = []
    skipped: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                skipped = exc  # this family is not enabled here (as asyncio does, bpo-30945)
                sockets.pop().close()
        if not sockets:
            raise skipped or OSError(errno.EADDRNOTAVAIL, "no address to bind")
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RdepthError(f"serve: port {port} on {host} is in use (another server?): choose another --port"
                              ) from None
        reason = exc.strerror or str(exc)
        raise RdepthError(f"serve: cannot listen on {host} port {port}: {reason}") from None
    return sockets
