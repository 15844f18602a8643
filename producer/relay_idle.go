package producer

import (
	"context"
	"errors"
	"time"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/outbox"
)

const (
	// positionCheckInterval is how often an idle shard checks that its
	// position is not ahead of the cluster's transaction ids.
	positionCheckInterval = time.Minute
)

// horizonWait is how often announce looks whether the transactions older
// than its mark have ended: 1ms, doubling, at most 50ms.
var horizonWait = eventline.Backoff{Initial: time.Millisecond, Multiplier: 2, Max: 50 * time.Millisecond}

// HandleError implements watermill-sql's BackoffManager. It is called after
// every read transaction ended, so waiting here holds no transaction; it
// returns 0 because it has already waited.
func (s *shardRunner) HandleError(_ watermillLogger, noMsg bool, err error) time.Duration {
	if err != nil {
		if s.stopping() || errors.Is(err, context.Canceled) || errors.Is(err, errShardStopped) {
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
		s.lastRows = time.Now()
		s.relay.poller.relayed(s.shard, s.lastBatch)
		s.unwait()
		if s.lastBatch >= s.relay.cfg.BatchSize {
			return 0 // a full batch: more rows are probably readable now
		}
		// The batch took every readable row: the next ones are not
		// committed yet, or held back. Reading again at once would find
		// nothing; the poller says when to.
		s.linger()
		return 0
	}
	s.idle()
	return 0
}

// idle waits for new rows after a read found none, without holding a
// transaction. A shard that relayed rows in the last hotWindow, or whose
// committed rows are held back by the xmin horizon, lingers (linger).
// Otherwise it asks producers to notify it (announce), reads once more, and
// then sleeps until a notification or PollInterval. Why producers notify
// only shards that ask: docs/DESIGN.md, "Waiting for rows".
func (s *shardRunner) idle() {
	if time.Since(s.lastRows) < hotWindow || s.stalledFor() > 0 {
		s.linger()
		return
	}
	if !s.waiting {
		if err := s.announce(); err != nil {
			s.log.Warn("announce idle shard; polling instead", "err", err)
			s.sleepOrWake(s.relay.cfg.PollInterval)
			return
		}
		s.waiting = true
		return // read once more: see announce
	}
	ctx, cancel := context.WithTimeout(s.soft, statementTimeout)
	var pending bool
	err := s.relay.pool.QueryRow(ctx, s.sql.backlogExists, outbox.RelayConsumerGroup, s.shard, s.waitTTL().Seconds(), s.waiting).Scan(&pending)
	cancel()
	if err == nil && pending {
		// Committed rows the last read could not see: an older transaction
		// holds the horizon. The poller reads them as soon as it passes.
		s.linger()
		return
	}
	s.unstall()
	if time.Since(s.lastPositionCheck) > positionCheckInterval {
		pctx, cancel := context.WithTimeout(s.soft, statementTimeout)
		s.checkPosition(pctx)
		cancel()
	}
	if s.sleepOrWake(s.relay.cfg.PollInterval) {
		s.unwait()
	}
}

// linger waits until the poller (or a notification) says the shard has
// rows to read, at most until its hot window ends or, while it is held
// back by the horizon, PollInterval.
func (s *shardRunner) linger() {
	wait := hotWindow - time.Since(s.lastRows)
	if s.stalledFor() > 0 || wait <= 0 {
		wait = s.relay.cfg.PollInterval
	}
	p := s.relay.poller
	p.watch(s)
	defer p.unwatch(s)
	s.sleepOrWake(wait)
}

// announce marks the shard as waiting for notifications and returns once
// every transaction older than the mark has ended, since one of them may
// have written a row without notifying (or PollInterval passed, when an old
// transaction stays open: then PollInterval bounds the delay).
func (s *shardRunner) announce() error {
	ctx, cancel := context.WithTimeout(s.soft, s.relay.cfg.PollInterval+statementTimeout)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.wait, s.shard, s.waitTTL().Seconds()); err != nil {
		return err
	}
	var xmax string
	if err := s.relay.pool.QueryRow(ctx, s.sql.snapshotXmax).Scan(&xmax); err != nil {
		return err
	}
	deadline := time.Now().Add(s.relay.cfg.PollInterval)
	for n := 1; time.Now().Before(deadline) && !s.stopping(); n++ {
		var passed bool
		if err := s.relay.pool.QueryRow(ctx, s.sql.horizonPassed, xmax).Scan(&passed); err != nil {
			return err
		}
		if passed {
			return nil
		}
		s.sleep(backoff.Delay(horizonWait, n))
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
	ctx, cancel := context.WithTimeout(context.Background(), statementTimeout)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.unwait, s.shard); err != nil {
		s.log.Debug("clear idle mark", "err", err)
	}
}

// stall records that the poller found the shard's next committed row held
// back by the xmin horizon, and returns how long that has lasted. After
// stallWarnAfter it warns, once, naming the transaction holding the
// horizon.
func (s *shardRunner) stall() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if s.stallSince.IsZero() {
		s.stallSince = now
		s.relay.metrics.set(stalledFlag, s.shard, true)
	}
	stalled := now.Sub(s.stallSince)
	if stalled > stallWarnAfter && !s.stallWarned {
		s.stallWarned = true
		go s.warnStalled()
	}
	return stalled
}

func (s *shardRunner) stalledFor() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stallSince.IsZero() {
		return 0
	}
	return time.Since(s.stallSince)
}

// warnStalled logs a stall with the transaction holding the horizon.
func (s *shardRunner) warnStalled() {
	s.mu.Lock()
	stalled := time.Since(s.stallSince).Round(time.Second)
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(s.soft, statementTimeout)
	defer cancel()
	h, err := outbox.ReadHorizonHolder(ctx, s.relay.pool)
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
		s.relay.metrics.add(stalledSecondsCounter, s.shard, time.Since(s.stallSince).Seconds())
		s.relay.metrics.set(stalledFlag, s.shard, false)
	}
	s.stallSince, s.stallWarned = time.Time{}, false
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

func (s *shardRunner) sleep(d time.Duration) { _ = backoff.Sleep(s.soft, d) }

func (s *shardRunner) takeBackoff() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := time.Until(s.backoffUntil)
	s.backoffUntil = time.Time{}
	return max(d, 0)
}

// retryDue reports whether a row may be published now, its retry not
// being pending (when it is, the shard waits at least until then), and
// whether it goes alone in its transaction (its last failure was
// failBatchTooLarge).
func (s *shardRunner) retryDue(outboxUUID string) (due, alone bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.failures[outboxUUID]
	if ok && time.Now().Before(rec.nextAttempt) {
		if rec.nextAttempt.After(s.backoffUntil) {
			s.backoffUntil = rec.nextAttempt
		}
		return false, false
	}
	return true, rec.alone
}
