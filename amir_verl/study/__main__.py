import sys

from amir_verl.study.study import main

sys.exit(main())
