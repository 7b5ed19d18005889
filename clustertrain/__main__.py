from clustertrain.cli import main

raise SystemExit(main())
