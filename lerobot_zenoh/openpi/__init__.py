"""The OpenPI front door: openpi-client robots served by the fleet (docs/openpi.md).

    wire.py        OpenPI's msgpack-numpy frames, decoded without ever making an object array
    mapping.py     the declarative OpenPI key -> camera / state / task mapping, checked against the status
    bridge.py      one Zenoh robot session per websocket connection (docs/protocol.md: obs out, chunk back)
    listener.py    the door's own accept loop: survives accept() errors, bounds sockets, TLS handshakes
    gate.py        before the handshake: /healthz, the token, the peer's cool-down, the client slots
    front_door.py  the websocket server: metadata, frames, limits, counted rejections
"""
