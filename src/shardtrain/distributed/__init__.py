"""The mesh and its named axes, the one communicator every collective goes through (it counts bytes and names a
failed collective's rank), tensor placements over a mesh axis, and failure diagnosis (dead peers, desynced ranks)."""
