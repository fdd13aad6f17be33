"""The reading side of the data: shards (make-shards' or anyone's WebDataset tars) and the in-memory demo set, read
into the uint8 batches the trainer consumes: index, decode, cache, sample, augment."""
