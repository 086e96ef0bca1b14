from sits_queue.errors import ConfigError, InvalidTaskOptions, SitsError

__all__ = ["ConfigError", "InvalidTaskOptions", "SitsError"]
