from shardtrain.zero.init import Init

__all__ = ["Init"]
