"""``MultiTokenMap``: several named token maps (one per task), each over its own shard stores."""
from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Sequence

from ds_maximus.errors import TokenMapError
from ds_maximus.store import ShardStore
from ds_maximus.tokenmap.token_map import TokenMap

MULTI_FILE = "multi_token_map.json"


class MultiTokenMap:
    """Named token maps with their stores, selected by name.

    Example::

        >>> import os, tempfile
        >>> from ds_maximus.tokenmap.train import train_tokenizer
        >>> d = tempfile.mkdtemp()
        >>> def token_map(text):   # a tokenizer trained on ``text``, its vocabulary ordered by the same text
        ...     tok = train_tokenizer(texts=[text] * 50, vocab_size=300, progress=False)
        ...     return TokenMap.build(tok, texts=[text] * 20, progress=False)
        >>> chem = token_map("aspirin is acetylsalicylic acid")
        >>> store = ShardStore.create(os.path.join(d, "chem_store"), chem.vocab_size, 8, rows_per_shard=32)
        >>> multi = MultiTokenMap()
        >>> _ = multi.add("chem", chem, stores=[store.path])
        >>> _ = multi.add("code", token_map("def main(): return 0"))
        >>> multi["chem"].encode("aspirin"), multi.stores("chem")[0].num_shards
        ([7], 9)
        >>> multi.save(os.path.join(d, "maps")); MultiTokenMap.load(os.path.join(d, "maps")).names
        ['chem', 'code']
        >>> import shutil; shutil.rmtree(d)
    """

    def __init__(self):
        self._maps: Dict[str, TokenMap] = {}
        self._stores: Dict[str, List[str]] = {}

    def add(self, name: str, token_map, stores: Sequence = ()) -> TokenMap:
        """Register ``token_map`` (a TokenMap or its folder) under ``name`` with its store folders."""
        if not name or not isinstance(name, str) or "/" in name:
            raise TokenMapError(f"token map name {name!r}: use a non-empty string without '/'")
        if name in self._maps:
            raise TokenMapError(f"a token map named {name!r} exists already; names: {self.names}")
        tm = token_map if isinstance(token_map, TokenMap) else TokenMap.load(token_map)
        paths = [s.path if isinstance(s, ShardStore) else os.path.abspath(s) for s in stores]
        for p in paths:
            st = ShardStore.open(p, loader=False)
            if st.vocab_size != tm.vocab_size:
                raise TokenMapError(f"store {p} has {st.vocab_size} rows but token map {name!r} has "
                                    f"{tm.vocab_size} tokens; pass the store built for this token map")
        self._maps[name], self._stores[name] = tm, paths
        return tm

    @property
    def names(self) -> List[str]:
        return sorted(self._maps)

    def __getitem__(self, name: str) -> TokenMap:
        try:
            return self._maps[name]
        except KeyError:
            raise TokenMapError(f"no token map named {name!r}; names: {self.names}") from None

    select = __getitem__

    def __contains__(self, name: str) -> bool:
        return name in self._maps

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._maps)

    def stores(self, name: str, loader=None) -> List[ShardStore]:
        """The shard stores of token map ``name``, opened."""
        self[name]
        return [ShardStore.open(p, loader=loader) for p in self._stores[name]]

    def extend(self, name: str, tokens: Sequence[str], progress: bool = True) -> List[int]:
        """Extend token map ``name`` and its stores (the other maps are untouched)."""
        return self[name].extend(tokens, stores=self.stores(name, loader=False), progress=progress)

    def save(self, path: str) -> None:
        """Save every map under ``path/<name>/`` and the list of maps and stores in ``multi_token_map.json``."""
        os.makedirs(path, exist_ok=True)
        entries = {}
        for name, tm in self._maps.items():
            sub = os.path.join(path, name)
            if tm.path is None or os.path.abspath(tm.path) != os.path.abspath(sub):
                tm.save(sub)
            entries[name] = {"token_map": name, "stores": [os.path.relpath(p, path) for p in self._stores[name]]}
        with open(os.path.join(path, MULTI_FILE), "w") as f:
            json.dump({"format": "ds_maximus.multi_token_map", "format_version": 1, "maps": entries}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "MultiTokenMap":
        f = os.path.join(path, MULTI_FILE)
        if not os.path.isfile(f):
            raise TokenMapError(f"{path} has no {MULTI_FILE}; save one with MultiTokenMap.save(path)")
        with open(f) as fh:
            d = json.load(fh)
        multi = cls()
        for name, e in d["maps"].items():
            multi.add(name, os.path.join(path, e["token_map"]), [os.path.join(path, s) for s in e["stores"]])
        return multi

    def __repr__(self) -> str:
        return f"MultiTokenMap({', '.join(f'{n}: V={self._maps[n].vocab_size}' for n in self.names)})"
