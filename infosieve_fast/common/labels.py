"""The label of an image that has none."""

NO_LABEL = -1  # the target of an image with no label at all: never a class, never scored
