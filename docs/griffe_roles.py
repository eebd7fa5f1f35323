"""A griffe extension for the API pages: Sphinx cross-reference roles in the docstrings
(``:func:`name```, ``:class:``, ``:meth:``, ``:mod:``, ``:data:``, ``:attr:``) render as
inline code instead of showing the role's markup."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` to ```target``` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
