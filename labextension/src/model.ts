// What the panel and the status bar show, refreshed by one poll that pauses while the tab is hidden.
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { api, IInfo, ISnapshot, IStatus, WorkstationError } from './api';

const INTERVAL = 15 * 1000;
const BUSY_INTERVAL = 2 * 1000; // while a snapshot is being taken or an operation runs

export class WorkstationModel {
  info: IInfo | null = null;
  status: IStatus | null = null;
  snapshots: ISnapshot[] = [];
  error: string | null = null;
  /** When the request for `status` was sent (ms since the epoch): what it says held then. */
  statusAt = 0;

  constructor() {
    this._poll = new Poll({
      factory: () => this._refresh(),
      frequency: { interval: INTERVAL, backoff: true, max: 5 * 60 * 1000 },
      standby: 'when-hidden',
      name: 'kubevirt-spawner:workstation'
    });
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Refresh now (after an action); the poll goes on, faster while something is under way. */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  /** Fetch the status now, even while the poll stands by (the idle warning checks its deadline). */
  async refreshStatus(): Promise<void> {
    if (this.info?.configured) {
      const sentAt = Date.now();
      this.status = await api.status();
      this.statusAt = sentAt;
      this._changed.emit();
    }
  }

  dispose(): void {
    this._poll.dispose();
  }

  private async _refresh(): Promise<void> {
    try {
      if (!this.info) {
        this.info = await api.info();
      }
      if (this.info.configured) {
        const sentAt = Date.now();
        const [status, snapshots] = await Promise.all([api.status(), api.snapshots()]);
        this.status = status;
        this.statusAt = sentAt;
        this.snapshots = snapshots;
      }
      this.error = null;
    } catch (error) {
      this.error = error instanceof WorkstationError ? error.message : String(error);
      this._changed.emit();
      throw error; // the poll backs off while the service or this server does not answer
    }
    this._changed.emit();
    const busy =
      this.snapshots.some(s => !s.ready && !s.error) || this.status?.operation?.state === 'running';
    // (read when the poll schedules its next tick, right after this one)
    this._poll.frequency = { ...this._poll.frequency, interval: busy ? BUSY_INTERVAL : INTERVAL };
  }

  private _poll: Poll;
  private _changed = new Signal<this, void>(this);
}

/** "12.3 GiB" */
export function formatBytes(bytes: number | null): string {
  if (bytes === null || bytes === undefined) {
    return '?';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  return `${value.toFixed(unit > 2 ? 1 : 0)} ${units[unit]}`;
}

/** "in 42 min", "in 1 h 5 min", "in 35 s" (under a minute), or "now" */
export function timeLeft(deadline: string, now = Date.now()): string {
  const seconds = Math.floor((Date.parse(deadline) - now) / 1000);
  if (seconds <= 0) {
    return 'now';
  }
  const minutes = Math.floor(seconds / 60);
  if (minutes === 0) {
    return `in ${seconds} s`;
  }
  return minutes < 60 ? `in ${minutes} min` : `in ${Math.floor(minutes / 60)} h ${minutes % 60} min`;
}
