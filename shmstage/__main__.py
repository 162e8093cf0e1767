from shmstage.cli import main

main()
