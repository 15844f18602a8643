package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestVersionNamesTheLibrary: the command is a module of its own, so
// `eventline version` says which library it was built with: the version
// its go.mod requires, or what replaced it (the repository's ../..).
func TestVersionNamesTheLibrary(t *testing.T) {
	t.Parallel()
	t.Run("the required version, or what replaced it", func(t *testing.T) {
		for _, tc := range []struct {
			dep  *debug.Module
			want string
		}{
			{&debug.Module{Path: libraryModule, Version: "v1.4.0"}, "v1.4.0"},
			{&debug.Module{Path: libraryModule, Version: "v0.0.0", Replace: &debug.Module{Path: "../.."}}, "(devel, replaced by ../..)"},
			{&debug.Module{Path: libraryModule, Version: "v0.0.0", Replace: &debug.Module{Path: "../..", Version: "(devel)"}}, "(devel, replaced by ../..)"},
			{&debug.Module{Path: libraryModule, Version: "v1.4.0", Replace: &debug.Module{Path: "example.com/fork", Version: "v1.4.1"}}, "v1.4.1 (replaced by example.com/fork)"},
			{&debug.Module{Path: "github.com/jackc/pgx/v5", Version: "v5.12.0"}, "(unknown)"},
		} {
			info := &debug.BuildInfo{Main: debug.Module{Path: "github.com/eventline/eventline/cmd/eventline"}, Deps: []*debug.Module{tc.dep}}
			require.Equal(t, tc.want, libraryVersion(info))
		}
		require.Equal(t, "v1.4.0", libraryVersion(&debug.BuildInfo{Main: debug.Module{Path: libraryModule, Version: "v1.4.0"}}), "built in the library's module")
	})

	t.Run("eventline version prints it", func(t *testing.T) {
		var out, errw bytes.Buffer
		require.Equal(t, 0, runWithEnv(context.Background(), []string{"version"}, &out, &errw, noEnv), errw.String())
		require.Contains(t, out.String(), "library github.com/eventline/eventline ")
	})

	t.Run("a built binary names the replaced library", func(t *testing.T) {
		if testing.Short() {
			t.Skip("builds the eventline command")
		}
		bin := filepath.Join(t.TempDir(), "eventline")
		build := exec.Command("go", "build", "-o", bin, ".")
		// With its own go.mod, as make builds it: a developer's go.work
		// would link the workspace's library instead of the replaced one.
		build.Env = append(os.Environ(), "GOWORK=off")
		out, err := build.CombinedOutput()
		require.NoError(t, err, "go build (in cmd/eventline): %s", out)
		out, err = exec.Command(bin, "version").CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "(library github.com/eventline/eventline (devel, replaced by ../..), go")
	})
}
