"""`cpud doctor`: what cpud will do on this machine with the given settings, one verdict per
item (ok / warn / fail) and advice naming the flag or env var to change.

Exit status: 0 no item failed (warnings allowed), 1 at least one item failed, 2 bad arguments.
Modules: args (flags), inputs (what is looked at), planning (the plans serving would make),
one module per group of checks, report (verdicts and printing), run (collect and print).
"""
