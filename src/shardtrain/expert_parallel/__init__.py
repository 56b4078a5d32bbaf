"""Expert parallelism (issue 38): the experts of each mixture-of-experts layer split over the ranks of a group, tokens
sent to their experts and back by all-to-all.

    dispatch.py  the token exchange around a transformers experts module, and the split of its expert weights

Not wired into the engine yet: the mesh axis, the expert-data-parallel ZeRO groups and checkpoints come next.
"""
