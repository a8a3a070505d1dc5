"""age encryption of exported files (https://age-encryption.org), through ``pyrage`` (the age library's
Python binding; the format is not something to write by hand).

An export whose owner names recipients (native ``age1...`` X25519 keys or SSH public keys) is stored only as
ciphertext: every file ``F`` becomes ``F.age``, readable by any one of the recipients' identities
(``age -d -i KEY F.age``, or ``pyrage.decrypt_file``), and the plaintext never stays on the worker's disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server_mock.errors import bad_request

SUFFIX = ".age"
MAX_RECIPIENTS = 10  # as Tinker's API takes at most 10


def parse_recipients(values: Any, field: str = "age_encryption_recipients") -> list:
    """The recipients named by ``values`` (a list of strings), or a 400 naming the one that is not a key."""
    if values is None:
        return []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise bad_request(field, "must be a list of age recipients (\"age1...\" keys or SSH public keys)")
    if len(values) > MAX_RECIPIENTS:
        raise bad_request(field, f"at most {MAX_RECIPIENTS} recipients, got {len(values)}")
    import pyrage

    out = []
    for i, value in enumerate(values):
        text = value.strip()
        try:
            out.append(pyrage.x25519.Recipient.from_str(text) if text.startswith("age1")
                       else pyrage.ssh.Recipient.from_str(text))
        except pyrage.RecipientError as exc:
            raise bad_request(f"{field}[{i}]", f"{value[:60]!r} is not an age recipient ({exc}); pass a native "
                                               "\"age1...\" key or an SSH public key (ssh-ed25519 / ssh-rsa)") from None
    return out


def encrypt_folder(folder: Path, recipients: list, skip: tuple[str, ...] = ("meta.json",)) -> None:
    """Replace every file in ``folder`` (but ``skip``) by its encryption to ``recipients``, named ``<file>.age``."""
    import pyrage

    for path in sorted(folder.iterdir()):
        if path.name in skip or not path.is_file():
            continue
        pyrage.encrypt_file(str(path), str(path) + SUFFIX, recipients)
        path.unlink()
