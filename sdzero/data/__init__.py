"""Image folders, aspect buckets, latent/text caches and the feed that makes typed step inputs."""
