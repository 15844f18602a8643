package producer

import (
	"context"
	"errors"
	"time"

	"github.com/eventline/eventline/internal/outbox"
)

const (
	// stallPollMin and stallPollMax bound the polling while committed rows
	// wait behind an older open transaction (the xmin horizon).
	stallPollMin   = 5 * time.Millisecond
	stallPollMax   = 500 * time.Millisecond
	stallFastPhase = 2 * time.Second
	// positionCheckInterval is how often an idle shard checks that its
	// position is not ahead of the cluster's transaction ids.
	positionCheckInterval = time.Minute
)

// HandleError implements watermill-sql's BackoffManager. It is called after
// every read transaction ended, so waiting here holds no transaction; it
// returns 0 because it has already waited.
func (s *shardRunner) HandleError(_ watermillLogger, noMsg bool, err error) time.Duration {
	if err != nil {
		if s.stopping() || errors.Is(err, context.Canceled) {
			return 0
		}
		s.log.Warn("outbox read failed; retrying", "err", err)
		s.sleep(queryRetryInterval)
		return 0
	}
	if d := s.takeBackoff(); d > 0 {
		s.sleep(d)
		return 0
	}
	if !noMsg {
		s.unstall()
		s.unwait()
		return 0
	}
	s.idle()
	return 0
}

// idle waits for new rows, without holding a transaction.
//
// Producers notify a shard only while its relay says it is waiting (the
// outbox_waiting row), because a NOTIFY serializes their commits. So before
// it sleeps, the shard sets that row and then waits until every transaction
// that started before it has ended: one of them may have written a row
// without notifying. It then reads once more, and only then sleeps until a
// notification or PollInterval. A notification clears the row again, so
// busy shards cost producers nothing.
//
// If committed rows exist that the last read could not see, an older open
// transaction holds the xmin horizon: poll again shortly instead.
func (s *shardRunner) idle() {
	if !s.waiting {
		if err := s.announce(); err != nil {
			s.log.Warn("announce idle shard; polling instead", "err", err)
			s.sleepOrWake(s.relay.cfg.PollInterval)
			return
		}
		s.waiting = true
		return // read once more: see announce
	}
	ctx, cancel := context.WithTimeout(s.soft, 5*time.Second)
	var pending bool
	err := s.relay.pool.QueryRow(ctx, s.sql.backlogExists, outbox.RelayConsumerGroup, s.shard, s.waitTTL().Seconds(), s.waiting).Scan(&pending)
	cancel()
	if err == nil && pending {
		d, warn := s.stall()
		if warn {
			s.warnStalled()
		}
		s.sleepOrWake(d)
		return
	}
	s.unstall()
	if time.Since(s.lastPositionCheck) > positionCheckInterval {
		pctx, cancel := context.WithTimeout(s.soft, 5*time.Second)
		s.checkPosition(pctx)
		cancel()
	}
	if s.sleepOrWake(s.relay.cfg.PollInterval) {
		s.unwait()
	}
}

// announce marks the shard as waiting for notifications and returns once
// every transaction older than the mark has ended (or PollInterval passed,
// when an old transaction stays open: then PollInterval bounds the delay).
func (s *shardRunner) announce() error {
	ctx, cancel := context.WithTimeout(s.soft, s.relay.cfg.PollInterval+5*time.Second)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.wait, s.shard, s.waitTTL().Seconds()); err != nil {
		return err
	}
	var xmax string
	if err := s.relay.pool.QueryRow(ctx, s.sql.snapshotXmax).Scan(&xmax); err != nil {
		return err
	}
	deadline := time.Now().Add(s.relay.cfg.PollInterval)
	for delay := time.Millisecond; time.Now().Before(deadline) && !s.stopping(); delay = min(2*delay, 50*time.Millisecond) {
		var passed bool
		if err := s.relay.pool.QueryRow(ctx, s.sql.horizonPassed, xmax).Scan(&passed); err != nil {
			return err
		}
		if passed {
			return nil
		}
		s.sleep(delay)
	}
	return nil
}

// waitTTL is how long a waiting mark lasts unless renewed: a few polls, so
// only a relay that died lets it lapse.
func (s *shardRunner) waitTTL() time.Duration {
	return max(3*s.relay.cfg.PollInterval, 10*time.Second)
}

// unwait clears the shard's waiting mark: it is busy again.
func (s *shardRunner) unwait() {
	if !s.waiting {
		return
	}
	s.waiting = false
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.unwait, s.shard); err != nil {
		s.log.Debug("clear idle mark", "err", err)
	}
}

// stall returns how long to wait before reading a shard whose committed
// rows are held back by the xmin horizon: 5ms for the first 2s, since
// horizons held by ordinary short transactions pass quickly, then growing
// to 500ms; warn is set once, when the stall has lasted 10s.
func (s *shardRunner) stall() (d time.Duration, warn bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if s.stallSince.IsZero() {
		s.stallSince = now
		s.relay.metrics.setStalled(s.shard, true)
	}
	stalled := now.Sub(s.stallSince)
	if stalled > 10*time.Second && !s.stallWarned {
		s.stallWarned, warn = true, true
	}
	if stalled < stallFastPhase {
		return stallPollMin, warn
	}
	s.stallDelay = min(max(2*s.stallDelay, stallPollMin), stallPollMax)
	return s.stallDelay, warn
}

// warnStalled logs a stall with the transaction holding the horizon.
func (s *shardRunner) warnStalled() {
	s.mu.Lock()
	stalled := time.Since(s.stallSince).Round(time.Second)
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(s.soft, 5*time.Second)
	defer cancel()
	h, err := ReadHorizonHolder(ctx, s.relay.pool)
	if err != nil || h == nil {
		s.log.Warn("relay stalled: committed events wait behind an older open transaction (xmin horizon); find it in pg_stat_activity", "stalled_for", stalled)
		return
	}
	s.log.Warn("relay stalled: committed events wait behind an older open transaction (xmin horizon); end it and they flow again",
		"stalled_for", stalled, "holder_pid", h.PID, "holder_xact_age", h.XactAge.Round(time.Second), "holder_state", h.State,
		"holder_application", h.ApplicationName, "holder_database", h.Database, "holder_prepared_gid", h.PreparedGID, "holder_query", h.Query)
}

func (s *shardRunner) unstall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.stallSince.IsZero() {
		s.relay.metrics.addStalled(s.shard, time.Since(s.stallSince))
		s.relay.metrics.setStalled(s.shard, false)
	}
	s.stallSince, s.stallDelay, s.stallWarned = time.Time{}, 0, false
}

// sleepOrWake waits for d, a notification or the shard's release, and
// reports whether a notification woke it.
func (s *shardRunner) sleepOrWake(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.wake:
		return true
	case <-s.soft.Done():
	}
	return false
}

func (s *shardRunner) stopping() bool { return s.soft.Err() != nil }

func (s *shardRunner) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.soft.Done():
	}
}

func (s *shardRunner) takeBackoff() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := time.Until(s.backoffUntil)
	s.backoffUntil = time.Time{}
	return max(d, 0)
}

// notDue reports whether a row's next retry is still in the future.
func (s *shardRunner) notDue(outboxUUID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.failures[outboxUUID]
	if ok && time.Now().Before(rec.nextAttempt) {
		if rec.nextAttempt.After(s.backoffUntil) {
			s.backoffUntil = rec.nextAttempt
		}
		return true
	}
	return false
}
