"""Input pipelines: resumable sampling, loaders and the device prefetcher."""
