import sys

from qdq_optuna.cli.main import main

sys.exit(main())
