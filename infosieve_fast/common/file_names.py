"""The one rule for a name that becomes a file or folder name (a cluster's name: `export` makes `labelled/<name>/`):
what every common file system takes. `infosieve name` checks it before writing RUN/names.json, and every reader of
names.json checks it again, so a hand-edited or downloaded run cannot put a file outside the folder it writes."""

from __future__ import annotations

import unicodedata

MAX_BYTES = 255  # ext4, XFS, APFS and NTFS all cap a name at 255 (bytes on the first three, UTF-16 units on NTFS)
FORBIDDEN = '/\\<>:"|?*'  # path separators, and what Windows file systems refuse
# names Windows reserves for devices, with any extension
RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a file or folder name on every common file system, or None when it can."""
    if not name:
        return "it is empty"
    if name.startswith("."):
        return "it starts with a dot (`.` and `..` name folders; a leading dot hides a file)"
    bad = sorted({c for c in name if c in FORBIDDEN})
    if bad:
        return f"it holds {' '.join(bad)} (path separators, and characters Windows refuses)"
    if any(unicodedata.category(c) == "Cc" for c in name):
        return "it holds a control character"
    if name != name.rstrip(" ."):
        return "it ends in a space or a dot (Windows drops them)"
    if name.split(".")[0].upper() in RESERVED:
        return f"{name.split('.')[0]} is a device name on Windows"
    size = len(name.encode("utf-8", errors="surrogatepass"))
    if size > MAX_BYTES:
        return f"it is {size} bytes long in UTF-8 (at most {MAX_BYTES})"
    return None
