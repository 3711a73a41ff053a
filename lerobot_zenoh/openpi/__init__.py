"""The OpenPI front door: openpi-client robots served by the fleet (docs/openpi.md).

    wire.py        OpenPI's msgpack-numpy frames, decoded without ever making an object array
    mapping.py     the declarative OpenPI key -> camera / state / task mapping, checked against the status
    bridge.py      one Zenoh robot session per websocket connection (docs/protocol.md: obs out, chunk back)
    front_door.py  the websocket server: metadata, /healthz, token, limits, counted rejections
"""
