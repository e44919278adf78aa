"""Seeing plans: an HTML report of a plan (``plan.report``), the cause of every collective of the
compiled program, plan diffs, and the ``jaxpar plan`` command.

Files, one idea each: ``hlo_meta`` (op metadata of compiled HLO), ``causes`` (collectives matched
to plan nodes), ``context`` (layers and module paths of nodes), ``svg`` / ``figures`` (plain SVG
pictures), ``explorer`` (the operator graph), ``page`` (HTML sections), ``diff`` (plan diffs),
``build`` (the report), ``command`` (the CLI).
"""
