package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func noEnv(string) string { return "" }

func TestHelpExits0AndListsTheScenarios(t *testing.T) {
	var out, errw bytes.Buffer
	code := run(context.Background(), []string{"-h"}, &out, &errw, noEnv)
	require.Equal(t, exitOK, code)
	require.Empty(t, out.String())
	for _, want := range []string{"Usage: eventline-bench [flags]", "producer_overhead", "end_to_end_latency", "-quick", "-scenarios names", "-profile DIR", "-database-url URL", "-brokers brokers"} {
		require.Contains(t, errw.String(), want)
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"extra"}, `takes no arguments, got ["extra"]`},
		{[]string{"-scenarios", "relay_drain,nope"}, `unknown scenario "nope"`},
		{[]string{"-brokers", "nohostport"}, `broker "nohostport" is not host:port`},
		{[]string{"-nope"}, "flag provided but not defined: -nope"},
	} {
		t.Run(tc.want, func(t *testing.T) {
			var out, errw bytes.Buffer
			code := run(context.Background(), tc.args, &out, &errw, noEnv)
			require.Equal(t, exitUsage, code)
			require.Contains(t, errw.String(), tc.want)
			require.Empty(t, out.String())
		})
	}
}

// TestTheLibraryModuleDoesNotHoldTheHarness is the point of this module:
// the harness and its in-process fakes stay out of the library's packages
// and of the CLI users install.
func TestTheLibraryModuleDoesNotHoldTheHarness(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	packages := goList(t, filepath.Join("..", ".."), "./...")
	require.Contains(t, packages, "github.com/eventline/eventline/producer\n", "go list ./... runs in the library module")
	require.NotContains(t, packages, "eventline-bench")
	// The CLI is a module of its own (cmd/eventline): its dependencies,
	// listed there, hold no harness either.
	deps := goList(t, filepath.Join("..", "eventline"), "-deps", ".")
	require.Contains(t, deps, "github.com/eventline/eventline/cmd/eventline\n", "go list -deps . runs in the CLI's module")
	require.NotContains(t, deps, "eventline-bench")
	require.NotContains(t, deps, "/bench")
}

// goList runs `go list args...` in dir (the library module, the
// repository's root, or the CLI's) with its own go.mod, and returns its
// output.
func goList(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	return string(out)
}
