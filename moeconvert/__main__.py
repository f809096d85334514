from moeconvert.cli import main

main()
