"""An import-linter contract type that import-linter lacks: no import cycles between modules.

`acyclic_siblings` (import-linter's own) forbids cycles between packages; xlaserve's packages
depend on each other in both directions by design (`engine.builder` uses `sharding.mesh`, which
uses `engine.errors`), but no two modules may import each other, directly or through others
(lazy and TYPE_CHECKING imports count).
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class AcyclicModulesContract(Contract):
    """Config: `packages`, the packages whose modules must form no cycle."""

    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        modules = {
            m for p in self.packages for m in graph.find_descendants(str(p)) | {str(p)}
        }  # fmt: skip
        cycles = []
        for module in sorted(modules):
            for imported in sorted(graph.find_modules_directly_imported_by(module) & modules):
                back = graph.find_shortest_chain(importer=imported, imported=module)
                if back is not None and module <= min(back):  # each cycle once
                    cycles.append((module, *back))
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error(" -> ".join(cycle))
            output.new_line()
