"""Reference networks: plain nn.Modules that know nothing of parallelism or precision."""
