import sys

from qdq_optuna.cli.commands import main

sys.exit(main())
