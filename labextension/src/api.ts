// Requests to the guest server extension (<base_url>/workstation/api/...), which forwards them to
// the hub's workstations service with this server's own token.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IDisk {
  size: string | null;
  used_bytes: number | null;
  total_bytes: number | null;
  percent: number | null;
  level: string | null; // ok, or the threshold passed: 70, 85, 95
  measured: string | null;
  live: boolean;
}

export interface IExtraDisk extends IDisk {
  name: string;
  path: string;
  claim: string;
}

export interface IShare {
  name: string;
  claim: string;
  path: string | null;
  read_only: boolean;
}

export interface IOperation {
  kind: string; // restore | reset
  state: string; // running | done | failed
  step: number; // 1-based
  steps: number;
  step_name: string;
  step_labels: string[];
  description: string;
  error: string | null;
}

export interface IUnits {
  cpu_hours: number;
  memory_gib_hours: number;
  gpu_hours: Record<string, number>;
  disk_gib_months: number;
  snapshot_gib_months: number;
  /** Priced by the site's prices; null without them. */
  cost: { currency: string; total: number } | null;
}

export interface ICost {
  month: string;
  currency: string | null;
  this_month: IUnits;
  per_hour: IUnits;
  held: { running: boolean; cpu: number; memory_gib: number; gpus: Record<string, number>; disk_gib: number; snapshot_gib: number };
}

export interface IQuota {
  name: string;
  hard: Record<string, string>;
  used: Record<string, string>;
}

export interface IStatus {
  user: string;
  server: string;
  phase: string;
  hub: { ready: boolean; pending: string | null; last_activity: string | null; url: string | null };
  profile: { slug: string; version: string };
  cpu: string | number | null;
  memory: string | null;
  gpus: string[];
  node: string | null;
  disks: {
    root: IDisk | null;
    workspace: IDisk | null;
    extra?: IExtraDisk[]; // the profile's data disks, kept like the workspace disk
    scratch?: IDisk | null; // blank at every start, on /scratch
    shared?: IShare[]; // the admin's claims, mounted through virtiofs
  };
  golden_image: { cloned_from: string | null; configured: string; newer_available: boolean };
  snapshots: {
    count: number;
    total_size: string | null;
    user_count?: number;
    limit?: number | null;
    retention?: string;
  };
  quota?: IQuota[] | null;
  cost?: ICost;
  operation: IOperation | null;
  keepalive_until: string | null;
  keepalive_max_minutes: number;
  agent_connected: boolean;
  snapshot_consistency: string;
  idle: {
    timeout_seconds: number;
    last_activity: string;
    deadline: string;
    warn_at: string;
    check_every_seconds: number | null;
  } | null;
  /** A drain of the node it runs on: when the service stops it. */
  drain?: { node: string; reason: string; since: string; deadline: string; grace_seconds: number } | null;
  /** Why a drain stopped it (while it is stopped). */
  last_stop?: { why: string; node: string; reason: string; at: string; text: string } | null;
  /** Why the running machine counts as in use, or since when it is idle. */
  activity: {
    reported: string | null;
    sources: { source: string; text: string; since: string | null }[];
    idle_since: string | null;
  } | null;
}

export interface ISnapshot {
  name: string;
  note: string;
  created: string | null;
  consistency: string | null;
  ready: boolean;
  phase: string | null;
  error: string | null;
}

export interface IInfo {
  user: string;
  server: string;
  service_page: string;
  /** The service's page where the user adds and deletes their SSH keys. */
  ssh_keys_page: string;
  configured: boolean;
  /** Where VS Code in the browser is on this server (`<base_url>vscode/`), or "" when it has none. */
  vscode_url: string;
}

/** A failure, with the sentence to show the user. */
export class WorkstationError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

async function call<T>(path: string, init: RequestInit = {}, poll = false): Promise<T> {
  const settings = ServerConnection.makeSettings();
  // A poll is not the user's activity: the server must not count it (nor keep the machine up).
  const url = URLExt.join(settings.baseUrl, 'workstation/api', path) + (poll ? '?no_track_activity=1' : '');
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new WorkstationError(
      'This workstation does not answer; it may be stopping or restarting. Try again in a minute.',
      0
    );
  }
  let data: any = null;
  try {
    data = await response.json();
  } catch (error) {
    data = null;
  }
  if (!response.ok) {
    const sentence =
      data && typeof data.error === 'string'
        ? data.error
        : `The request failed (${response.status} ${response.statusText}).`;
    throw new WorkstationError(sentence, response.status);
  }
  return data as T;
}

function post<T>(path: string, body: unknown): Promise<T> {
  return call<T>(path, { method: 'POST', body: JSON.stringify(body) });
}

export const api = {
  info: () => call<IInfo>('info', {}, true),
  status: () => call<IStatus>('status', {}, true),
  snapshots: () => call<{ snapshots: ISnapshot[] }>('snapshots', {}, true).then(r => r.snapshots),
  takeSnapshot: (name: string, note: string) =>
    post<ISnapshot>('snapshots', { name: name || null, note }),
  restore: (snapshot: string) => post<unknown>('restore', { snapshot, confirm: true }),
  reset: (confirm: string) => post<unknown>('reset', { confirm }),
  stop: () => post<unknown>('stop', { wait: false }),
  keepalive: (minutes: number) => post<{ keepalive_until: string }>('keepalive', { minutes })
};

/** The name a reset is confirmed with: user, or user/server. */
export function workstationName(info: IInfo): string {
  return info.server ? `${info.user}/${info.server}` : info.user;
}
