"""The canary manifest: the secrets, their prefixes, who is a member, and which tokenizer they belong to.

It is the only place membership is written down: the secrets and the augmented dataset do not reveal it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.safe_json import load_json_file
from dpaudit.core.errors import DPAuditError

FORMAT = "dpaudit-canaries/1"
# An audit's power saturates long before this (the bounds gain little past ~10^4 canaries), while each
# canary is a new token in the tokenizer and a row in both embedding matrices: more is refused unread.
MAX_CANARIES = 100_000
NEW_TOKEN_PREFIX = 1  # random tokens before a new-token secret: a longer prefix is more loss to learn, whose gradient
# crowds the secret's row out of the clipped norm (embedded default, one canary's gradient: 27 % of its norm on the
# row with 1 token, 14 % with 2, 5 % with 8; a whole-model AdamW run at claimed eps 4 read AUC 0.61 against 0.51;
# audit run's black box: median 0.15 -> 0.53)


KINDS = ("new-token", "existing")  # a new vocabulary token (the model is extended), or a span of the model's own


CANARY_USER = "dpaudit-canary-{}"  # the user id a canary user's records carry in a user-level dataset's user column
MAX_USER_RECORDS = 64  # prefixes of a canary user (records trained plus held out): a user inference needs a few


@dataclass(frozen=True)
class Canary:
    index: int
    secret: str     # the new vocabulary token ("new-token"), or a span of existing tokens, as text ("existing")
    prefix: str     # text that precedes it
    member: bool
    # A canary user (user-level audits): its other records' prefixes, each followed by the same secret (a member's
    # records are all inserted), and held-out prefixes never inserted, which the user-inference score reads
    # (Kandpal et al. 2023: the likelihood ratio of a user's unseen records). Empty: a canary of one record.
    others: tuple[str, ...] = ()
    held_out: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return self.prefix + self.secret

    @property
    def texts(self) -> list[str]:
        """The records a member adds to the training data: its text, then its other records'."""
        return [self.text, *(p + self.secret for p in self.others)]


@dataclass(frozen=True)
class TokenizerIdentity:
    name_or_path: str
    base_vocab_size: int
    fingerprint: str  # sha256 of the base vocabulary (token, id) pairs


@dataclass
class Manifest:
    seed: int
    tokenizer: TokenizerIdentity
    prefix_kind: str          # "random-tokens" or "template"
    prefix_length: int | None
    canaries: list[Canary]
    inclusion_probability: float = 0.5
    format: str = field(default=FORMAT)
    kind: str = "new-token"
    secret_length: int | None = None  # tokens in an "existing" canary's secret span

    @property
    def secrets(self) -> list[str]:
        return [c.secret for c in self.canaries]

    @property
    def members(self) -> list[Canary]:
        return [c for c in self.canaries if c.member]

    def to_dict(self) -> dict:
        return {
            "format": self.format, "seed": self.seed, "m": len(self.canaries),
            "inclusion_probability": self.inclusion_probability,
            "tokenizer": asdict(self.tokenizer),
            "prefix": {"kind": self.prefix_kind, "length": self.prefix_length},
            "kind": self.kind, "secret_length": self.secret_length,
            "canaries": [asdict(c) for c in self.canaries],
        }

    def save(self, path: Path) -> Path:
        """Written 0600: the manifest holds the audit's secret (which canaries are members)."""
        return atomic_write_json(path, self.to_dict(), private=True)


def load_manifest(path: Path) -> Manifest:
    path = Path(path)
    if not path.is_file():
        raise DPAuditError(f"canary manifest not found: {path}")
    data = load_json_file(path, "canary manifest", max_bytes=MAX_CANARIES * 4096)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DPAuditError(f"{path} is not a dpaudit canary manifest (expected format {FORMAT!r})")
    try:
        canaries = [Canary(int(c["index"]), str(c["secret"]), str(c["prefix"]), bool(c["member"]),
                           _prefixes(c.get("others", ())), _prefixes(c.get("held_out", ())))
                    for c in data["canaries"]]
        manifest = Manifest(
            seed=int(data["seed"]), tokenizer=TokenizerIdentity(**data["tokenizer"]),
            prefix_kind=str(data["prefix"]["kind"]), prefix_length=data["prefix"]["length"],
            canaries=canaries, inclusion_probability=float(data["inclusion_probability"]),
            kind=str(data.get("kind", "new-token")), secret_length=data.get("secret_length"))
    except (KeyError, TypeError, ValueError) as exc:
        raise DPAuditError(f"canary manifest {path} is malformed: {exc!r}") from None
    if not canaries:
        raise DPAuditError(f"canary manifest {path} holds no canaries")
    if manifest.kind not in KINDS:
        raise DPAuditError(f"canary manifest {path}: unknown canary kind (use {' or '.join(KINDS)})")
    if len(canaries) > MAX_CANARIES:
        raise DPAuditError(f"canary manifest {path} holds {len(canaries)} canaries; dpaudit takes at most "
                           f"{MAX_CANARIES}")
    if len({(len(c.others), len(c.held_out)) for c in canaries}) != 1:
        raise DPAuditError(f"canary manifest {path}: its canary users hold different numbers of records")
    if len(set(manifest.secrets)) != len(canaries):
        raise DPAuditError(f"canary manifest {path} repeats a secret token")
    return manifest


def _prefixes(value) -> tuple[str, ...]:
    """A canary user's prefixes as the manifest lists them, within MAX_USER_RECORDS."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_USER_RECORDS:
        raise ValueError(f"a canary user's prefixes are a list of at most {MAX_USER_RECORDS}")
    return tuple(str(p) for p in value)


def is_canary_user(value) -> bool:
    """Whether a user column's value is a canary user's id (CANARY_USER): real data must not hold one."""
    return isinstance(value, str) and value.startswith(CANARY_USER.format(""))
