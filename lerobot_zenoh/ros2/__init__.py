"""The ROS 2 front door: ROS 2 robots on rmw_zenoh served by the fleet, no bridge (docs/ros2.md).

    graph.py    rmw_zenoh's names: data keys, the attachment, liveliness tokens (the ROS graph)
    cdr.py      the messages read (bounded CDR readers) and written (rosbags), RIHS01 type hashes
    mapping.py  the declared topics -> cameras, state, action topic and joints; checked against the status
    robot.py    one ROS 2 robot as a LeRobot `Robot`: its subscriptions, latest samples, publishers
    door.py     the front door: one robot client of the fleet (client/) per configured ROS 2 robot

It imports the client's parts (client/, scheduling/, protocol/, transport/) and zenoh; nothing in
the server imports it, and it imports nothing of the server.
"""
