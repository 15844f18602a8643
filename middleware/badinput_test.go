package middleware_test

import (
	"context"
	"math"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// TestConstructorsRefuseWhatFailsLater: values the constructor accepted
// and that then failed on every event are refused, naming the field. A nil
// *pgxpool.Pool passed the dead letters' == nil check and panicked on the
// first dead letter (and the sweeper's, on the first sweep); a Group with
// a NUL byte or invalid UTF-8 failed in PostgreSQL on every event, and a
// blank one passed as a name.
func TestConstructorsRefuseWhatFailsLater(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	var nilPool *pgxpool.Pool

	_, err := middleware.New(nilPool, middleware.Config{Group: "g", Schema: env.Schema})
	require.ErrorContains(t, err, "middleware.New: db is nil")
	_, err = middleware.New(env.Pool, middleware.Config{Group: "g", Schema: env.Schema})
	require.NoError(t, err)

	for _, group := range []string{"g\x00", "g-\xff", " "} {
		_, err = middleware.New(env.Pool, middleware.Config{Group: group, Schema: env.Schema})
		require.ErrorContains(t, err, "middleware.Config.Group", "%q", group)
	}
}

// TestReleaseUnderAnUnknownHandlerFailsWithErrNoHandler: a parked event
// whose handler name no handler was added under is not released through
// nil (Register(name, nil) on a middleware with Upcasters registered the
// upcasting wrapper around nil, so the sweeper's release panicked in its
// goroutine, with nothing to recover it): the release fails with
// ErrNoHandler, saying what to add.
func TestReleaseUnderAnUnknownHandlerFailsWithErrNoHandler(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	up, err := eventline.NewUpcasters(map[string]int{"thing.changed": 1})
	require.NoError(t, err)
	el, err := middleware.New(env.Pool, middleware.Config{Group: "g", Schema: env.Schema, Upcasters: up, Logger: quiet()})
	require.NoError(t, err)
	_ = el.MiddlewareFor("other-handler")(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_ = el.MiddlewareFor("another-handler")(func(*message.Message) ([]*message.Message, error) { return nil, nil })

	msg, err := eventline.Encode(eventline.Event{Type: "thing.changed", AggregateType: "thing", AggregateID: "1", AggregateVersion: 2, Payload: []byte(`{}`)})
	require.NoError(t, err)
	p := store.Parked{Group: "g", AggregateType: "thing", AggregateID: "1", Version: 2, EventID: msg.UUID, EventType: "thing.changed",
		Handler: "things-handler", Topic: "things", Payload: msg.Payload, Metadata: msg.Metadata}
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NotPanics(t, func() { err = el.ApplyParked(ctx, tx, p) })
	require.ErrorIs(t, err, versioning.ErrNoHandler)
	require.ErrorContains(t, err, "AddHandler")
}

// TestNewConfigProperty draws middleware configurations with zero,
// negative and huge durations and counts, NaN and infinite retry floats,
// unknown policies and odd names, a few fields at a time. New never
// panics or starts anything; it accepts the configuration or names, in
// its error, a field the draw set; and it never accepts a value no run
// can use.
func TestNewConfigProperty(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	durations := []time.Duration{0, -1, middleware.NoTxTimeout, -time.Hour, math.MinInt64, 1, time.Second, time.Hour, math.MaxInt64}
	floats := []float64{0, -1, 0.5, 1, 2, 1e300, math.Inf(1), math.Inf(-1), math.NaN()}
	rapid.Check(t, func(rt *rapid.T) {
		cfg := middleware.Config{Group: "g", Schema: env.Schema, Logger: quiet()}
		set := map[string]bool{}
		unusable := false
		dur := func(name string, d *time.Duration) func() {
			return func() { *d = rapid.SampledFrom(durations).Draw(rt, name); set[name] = *d != 0 }
		}
		flt := func(name string, f *float64, none float64) func() {
			return func() {
				*f = rapid.SampledFrom(floats).Draw(rt, name)
				set[name] = *f != 0
				unusable = unusable || math.IsNaN(*f) || math.IsInf(*f, 0) || (*f < 0 && *f != none)
			}
		}
		backoff := func(name string, b *eventline.Backoff, noJitter float64) []func() {
			return []func(){dur(name+".Initial", &b.Initial), dur(name+".Max", &b.Max),
				flt(name+".Multiplier", &b.Multiplier, 0), flt(name+".Jitter", &b.Jitter, noJitter)}
		}
		perturb := []func(){
			dur("ParkTimeout", &cfg.ParkTimeout), dur("SweepInterval", &cfg.SweepInterval), dur("TxTimeout", &cfg.TxTimeout),
			func() {
				cfg.MaxRetries = rapid.SampledFrom([]int{middleware.NoRetries, -2, 1, math.MaxInt, math.MinInt}).Draw(rt, "MaxRetries")
				set["MaxRetries"] = true
			},
			func() {
				cfg.MaxGap = rapid.SampledFrom([]int64{-1, 1, math.MaxInt64, math.MinInt64}).Draw(rt, "MaxGap")
				set["MaxGap"] = true
			},
			func() {
				cfg.SweepBatch = rapid.SampledFrom([]int{-1, 1, math.MaxInt, math.MinInt}).Draw(rt, "SweepBatch")
				set["SweepBatch"] = true
			},
			func() {
				cfg.MaxReleaseAttempts = rapid.SampledFrom([]int{-1, 1, math.MaxInt, math.MinInt}).Draw(rt, "MaxReleaseAttempts")
				set["MaxReleaseAttempts"] = true
			},
			func() {
				cfg.GapPolicy = versioning.GapPolicy(rapid.SampledFrom([]string{"park", "apply", "Park", " ", "x"}).Draw(rt, "GapPolicy"))
				set["GapPolicy"] = true
				unusable = unusable || (cfg.GapPolicy != versioning.Park && cfg.GapPolicy != versioning.Apply)
			},
			func() {
				cfg.PolicyByType = map[string]versioning.GapPolicy{rapid.SampledFrom([]string{"", "t"}).Draw(rt, "policyType"): "nope"}
				set["PolicyByType"] = true
				unusable = true
			},
			func() {
				cfg.Unversioned = versioning.UnversionedPolicy(rapid.SampledFrom([]string{"pass", "reject", "x"}).Draw(rt, "Unversioned"))
				set["Unversioned"] = true
				unusable = unusable || (cfg.Unversioned != versioning.PassUnversioned && cfg.Unversioned != versioning.RejectUnversioned)
			},
			func() {
				cfg.Group = rapid.SampledFrom([]string{"", " ", "g\x00", "\xff", "g'; drop table x; --"}).Draw(rt, "Group")
				set["Group"] = true
				unusable = unusable || cfg.Group != "g'; drop table x; --"
			},
			func() {
				cfg.Schema = rapid.SampledFrom([]string{`x"; drop schema public; --`, "pg_x", strings.Repeat("s", 64)}).Draw(rt, "Schema")
				set["Schema"] = true
				unusable = true
			},
		}
		perturb = append(perturb, backoff("Retry", &cfg.Retry, middleware.NoJitter)...)
		perturb = append(perturb, backoff("InfraBackoff", &cfg.InfraBackoff, 0)...)
		perturb = append(perturb, backoff("ReleaseBackoff", &cfg.ReleaseBackoff, 0)...)
		for _, i := range rapid.SliceOfNDistinct(rapid.IntRange(0, len(perturb)-1), 1, 3, rapid.ID[int]).Draw(rt, "fields") {
			perturb[i]()
		}
		el, err := middleware.New(env.Pool, cfg)
		if err == nil {
			require.False(rt, unusable, "New accepted a configuration no run can use")
			require.NotNil(rt, el)
			return
		}
		named := false
		for field := range set {
			if regexp.MustCompile(`\b` + field + `\b`).MatchString(err.Error()) {
				named = true
			}
		}
		require.True(rt, named, "the error names none of the fields the draw set (%v): %v", set, err)
	})
}
