from glm5lab.cli import main

raise SystemExit(main())
