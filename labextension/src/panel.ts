// The left-sidebar panel: the machine, its disks, its snapshots and the actions on it.
import { Widget } from '@lumino/widgets';

import * as actions from './actions';
import { ICost, IDisk, IQuota, IStatus } from './api';
import { h } from './dom';
import { formatBytes, timeLeft, WorkstationModel } from './model';

/** A selector that finds the focused button again after a render (its class and snapshot). */
function focusKey(element: Element | null, root: HTMLElement): string | null {
  if (!(element instanceof HTMLButtonElement) || !root.contains(element)) {
    return null;
  }
  const action = [...element.classList].find(c => c.startsWith('kvs-') && c !== 'kvs-button' && c !== 'kvs-danger');
  if (!action) {
    return null;
  }
  const snapshot = element.closest('.kvs-snapshot')?.getAttribute('data-name');
  return snapshot ? `.kvs-snapshot[data-name="${CSS.escape(snapshot)}"] .${action}` : `.kvs-actions .${action}`;
}

export class WorkstationPanel extends Widget {
  constructor(readonly model: WorkstationModel) {
    super();
    this.id = 'kubevirt-workstation';
    this.addClass('kvs-panel');
    this.title.caption = 'Workstation';
    model.changed.connect(this.render, this);
    this.render();
  }

  render(): void {
    const { status, info, error, snapshots } = this.model;
    // Only when something changed, and keeping the keyboard focus where it was.
    const shown = JSON.stringify([
      status, info, error, snapshots,
      status?.idle && timeLeft(status.idle.deadline), status?.drain && timeLeft(status.drain.deadline)
    ]);
    if (shown === this._shown) {
      return;
    }
    this._shown = shown;
    const focused = focusKey(document.activeElement, this.node);
    const body: (HTMLElement | null)[] = [h('h2', { class: 'kvs-title' }, 'Workstation')];
    if (error) {
      body.push(h('div', { class: 'kvs-alert kvs-error', role: 'alert' }, error));
    }
    if (info && !info.configured) {
      body.push(h('p', {}, 'This server was not started by a hub with the workstations service.'));
    }
    if (status) {
      body.push(this.operation(status), this.summary(status), this.disks(status), this.buttons(), this.snapshotList());
    } else if (!error) {
      body.push(h('p', { class: 'kvs-hint' }, 'Loading…'));
    }
    this.node.replaceChildren(...body.filter((e): e is HTMLElement => e !== null));
    if (focused) {
      (this.node.querySelector(focused) as HTMLElement | null)?.focus();
    }
  }

  private _shown = '';

  private operation(status: IStatus): HTMLElement | null {
    const op = status.operation;
    if (!op || op.state === 'done') {
      return null;
    }
    const text =
      op.state === 'failed'
        ? `The ${op.kind} failed: ${op.error ?? 'see the workstation page'}`
        : `The workstation is ${op.description}.`;
    return h('div', { class: `kvs-alert ${op.state === 'failed' ? 'kvs-error' : 'kvs-warn'}`, role: 'status' }, text);
  }

  private summary(status: IStatus): HTMLElement {
    const row = (label: string, value: string | HTMLElement) => [h('dt', {}, label), h('dd', {}, value)];
    const image = h('span', {}, status.golden_image.cloned_from ?? 'unknown');
    if (status.golden_image.newer_available) {
      image.append(
        h('span', { class: 'kvs-notice' }, `A newer system image is available (${status.golden_image.configured}); a reset installs it.`)
      );
    }
    const idle = status.idle
      ? row('Idle stop', `${timeLeft(status.idle.deadline)} without activity`)
      : [];
    const drain = status.drain
      ? row(
          'Node drain',
          `${status.drain.node}${status.drain.reason ? ` (${status.drain.reason})` : ''}: stopped ` +
            `${timeLeft(status.drain.deadline)}; its disks are kept and the next start goes to another node`
        )
      : [];
    const cost = status.cost ? row('Cost', costText(status.cost)) : [];
    const quota = (status.quota ?? []).length ? row('Quota', quotaText(status.quota ?? [])) : [];
    const why = status.activity;
    const inUse = !why
      ? []
      : why.sources.length
        ? row('In use', h('ul', { class: 'kvs-activity' }, ...why.sources.map(s => h('li', {}, s.text))))
        : why.idle_since
          ? row('In use', `no; idle since ${new Date(why.idle_since).toLocaleTimeString()}`)
          : [];
    return h(
      'dl',
      { class: 'kvs-summary' },
      ...row('Profile', `${status.profile.slug || 'default'}${status.profile.version ? ` (version ${status.profile.version})` : ''}`),
      ...row('CPUs', String(status.cpu ?? '?')),
      ...row('Memory', String(status.memory ?? '?')),
      ...row('GPUs', status.gpus.length ? status.gpus.join(', ') : 'none'),
      ...row('Node', status.node ?? '–'),
      ...row('System image', image),
      ...drain,
      ...idle,
      ...inUse,
      ...cost,
      ...quota
    );
  }

  private disks(status: IStatus): HTMLElement {
    const DISK_NAMES: Record<string, string> = {
      root: 'System disk',
      workspace: 'Workspace disk',
      scratch: 'Scratch disk (/scratch, emptied at every start)'
    };
    const bar = (label: string, disk: IDisk | null, title?: string) => {
      if (!disk) {
        return null;
      }
      const percent = disk.percent ?? 0;
      const used =
        disk.percent === null
          ? `${disk.size ?? '?'} (usage not known yet)`
          : `${formatBytes(disk.used_bytes)} of ${formatBytes(disk.total_bytes)} used (${disk.percent} %)${disk.live ? '' : ', last known'}`;
      return h(
        'div',
        { class: `kvs-disk kvs-level-${disk.level ?? 'unknown'}`, 'data-disk': label },
        h('div', { class: 'kvs-disk-label' }, `${title ?? DISK_NAMES[label] ?? label} · ${disk.size ?? ''}`),
        h(
          'div',
          {
            class: 'kvs-bar',
            role: 'progressbar',
            'aria-valuemin': '0',
            'aria-valuemax': '100',
            'aria-valuenow': String(percent),
            'aria-label': `${label} disk usage`
          },
          h('div', { class: 'kvs-bar-fill', style: `width: ${Math.min(100, percent)}%` })
        ),
        h('div', { class: 'kvs-hint' }, used)
      );
    };
    const shares = (status.disks.shared ?? []).map(share =>
      h(
        'div',
        { class: 'kvs-share', 'data-share': share.name },
        h('div', { class: 'kvs-disk-label' }, `${share.path ?? share.name} · ${share.read_only ? 'read-only' : 'read-write'}`),
        h('div', { class: 'kvs-hint' }, `shared data (${share.claim})`)
      )
    );
    return h(
      'section',
      { class: 'kvs-disks' },
      bar('root', status.disks.root),
      bar('workspace', status.disks.workspace),
      ...(status.disks.extra ?? []).map(disk => bar(`disk-${disk.name}`, disk, `Disk ${disk.name} (${disk.path})`)),
      bar('scratch', status.disks.scratch ?? null),
      ...shares
    );
  }

  private buttons(): HTMLElement {
    const button = (label: string, cls: string, run: () => Promise<void>) =>
      h('button', { class: `jp-Button kvs-button ${cls}`, type: 'button', onclick: () => void run() }, label);
    return h(
      'div',
      { class: 'kvs-actions' },
      button('Take snapshot', 'kvs-take-snapshot', () => actions.takeSnapshot(this.model)),
      button('Reset system', 'kvs-reset kvs-danger', () => actions.reset(this.model)),
      button('Stop workstation', 'kvs-stop', () => actions.stop(this.model)),
      this.model.status?.idle
        ? button(`Keep running (${actions.keepRunningMinutes(this.model)} min)`, 'kvs-keep', () => actions.keepRunning(this.model))
        : null
    );
  }

  private snapshotList(): HTMLElement {
    const newestFirst = [...this.model.snapshots].sort((a, b) => (b.created ?? '9').localeCompare(a.created ?? '9'));
    const rows = newestFirst.map(s =>
      h(
        'li',
        { class: 'kvs-snapshot', 'data-name': s.name, 'data-ready': String(s.ready) },
        h('div', { class: 'kvs-snapshot-name' }, s.name),
        s.note ? h('div', { class: 'kvs-snapshot-note' }, s.note) : null,
        h(
          'div',
          { class: 'kvs-hint' },
          `${s.created ? new Date(s.created).toLocaleString() : 'being taken'} · ${s.consistency ?? '…'} · `,
          h('span', { class: 'kvs-snapshot-state' }, s.ready ? 'ready' : s.error ? `failed: ${s.error}` : 'not ready yet')
        ),
        h(
          'div',
          { class: 'kvs-snapshot-actions' },
          h(
            'button',
            {
              class: 'jp-Button kvs-button kvs-restore',
              type: 'button',
              disabled: !s.ready,
              'aria-label': `Restore snapshot ${s.name}`,
              onclick: () => void actions.restore(this.model, s.name)
            },
            'Restore'
          ),
          h(
            'button',
            {
              class: 'jp-Button kvs-button kvs-delete',
              type: 'button',
              'aria-label': `Delete snapshot ${s.name}`,
              onclick: () => void actions.deleteSnapshot(this.model, s.name)
            },
            'Delete'
          )
        )
      )
    );
    const info = this.model.status?.snapshots;
    const limit = info?.limit
      ? h('p', { class: 'kvs-hint' }, `${info.user_count} of ${info.limit} snapshots (all your workstations). ${info.retention}`)
      : info?.retention
        ? h('p', { class: 'kvs-hint' }, info.retention)
        : null;
    return h(
      'section',
      { class: 'kvs-snapshots' },
      h('h3', {}, 'Snapshots'),
      rows.length ? h('ul', {}, ...rows) : h('p', { class: 'kvs-hint' }, 'No snapshots yet.'),
      ...(limit ? [limit] : [])
    );
  }
}

/** "12.40 EUR this month; 0.35 EUR an hour now", or the units without prices. */
export function costText(cost: ICost): string {
  const month = cost.this_month;
  const now = cost.per_hour;
  if (month.cost && now.cost) {
    const currency = cost.currency ?? '';
    return `${month.cost.total.toFixed(2)} ${currency} this month; ${now.cost.total.toFixed(2)} ${currency} an hour now`;
  }
  const gpu = Object.values(month.gpu_hours).reduce((a, b) => a + b, 0);
  return (
    `this month ${month.cpu_hours.toFixed(1)} CPU-hours, ${gpu.toFixed(1)} GPU-hours, ` +
    `${(month.disk_gib_months + month.snapshot_gib_months).toFixed(1)} GiB-months of disk and snapshots`
  );
}

/** "requests.storage 140Gi of 1Ti, requests.cpu 4 of 16" */
export function quotaText(quotas: IQuota[]): string {
  return quotas
    .flatMap(q => Object.entries(q.hard).map(([key, hard]) => `${key} ${q.used[key] ?? '0'} of ${hard}`))
    .join(', ');
}
