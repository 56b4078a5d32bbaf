"""Adapters from other training front ends to the shardtrain engine (imported on use: each needs its framework)."""
