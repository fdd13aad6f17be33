"""The writing side of the data: `infosieve make-shards` reads a dataset in its native layout (or your own
`labelled/` + `unlabelled/` folders), encodes every image once and writes WebDataset shards with `manifest.json`."""
