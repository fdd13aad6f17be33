"""Config YAML read without anchors and aliases: `&a [..]` and `*a` let a few hundred bytes stand for a structure of
billions of nodes (each alias a reference to the whole anchored value), which every later pass over the config (the
checks, the copy saved with the run, the checkpoint's) walks in full. No shipped config uses them; a config that
needs a repeat writes it out."""

from __future__ import annotations

import yaml


class _NoAliasLoader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML anchors and aliases (&name, *name) are not allowed in a config: write the value out where it "
                "is used",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def load_yaml(text: str):
    """`yaml.safe_load` of `text`, refusing anchors and aliases (`yaml.YAMLError`)."""
    return yaml.load(text, Loader=_NoAliasLoader)
