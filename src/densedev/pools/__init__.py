"""The pools stage: the configuration and which devices each pool serves."""
