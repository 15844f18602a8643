package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/eventline/eventline/internal/bench"
)

func main() {
	quick := flag.Bool("quick", false, "")
	sc := flag.String("scenarios", "", "")
	prof := flag.String("profile", "", "")
	flag.Parse()
	cfg := bench.Config{Quick: *quick, ProfileDir: *prof}
	if *sc != "" {
		cfg.Scenarios = strings.Split(*sc, ",")
	}
	if _, err := bench.Run(context.Background(), cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
