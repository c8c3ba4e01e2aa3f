// What the buttons and commands do: confirm, call the service, show its sentence on failure, and
// for restore, reset and stop follow the operation until this page has to leave for the service's.
import { Dialog, InputDialog, Notification, showDialog, showErrorMessage } from '@jupyterlab/apputils';

import { api, IInfo, workstationName, WorkstationError } from './api';
import { StepList, SnapshotForm, TypedConfirmation } from './dialogs';
import { timeLeft, WorkstationModel } from './model';

const TITLE = 'Workstation';

async function failed(error: unknown): Promise<void> {
  const sentence = error instanceof WorkstationError ? error.message : String(error);
  await showErrorMessage(TITLE, sentence);
}

/** Make the call; on failure show the service's sentence. Whether it succeeded. */
async function attempt(call: () => Promise<unknown>): Promise<boolean> {
  try {
    await call();
    return true;
  } catch (error) {
    await failed(error);
    return false;
  }
}

function ready(model: WorkstationModel): IInfo | null {
  if (!model.info || !model.info.configured) {
    void showErrorMessage(
      TITLE,
      model.error ?? 'This server was not started by a hub with the workstations service.'
    );
    return null;
  }
  return model.info;
}

async function pickSnapshot(model: WorkstationModel, title: string, readyOnly: boolean): Promise<string | undefined> {
  const choices = model.snapshots.filter(s => s.ready || !readyOnly).map(s => s.name);
  if (!choices.length) {
    await showErrorMessage(TITLE, readyOnly ? 'There is no snapshot ready to restore.' : 'There are no snapshots.');
    return undefined;
  }
  const picked = await InputDialog.getItem({ title, items: choices });
  return picked.button.accept && picked.value ? picked.value : undefined;
}

export async function takeSnapshot(model: WorkstationModel): Promise<void> {
  if (!ready(model)) {
    return;
  }
  const result = await showDialog({
    title: 'Take a snapshot',
    body: new SnapshotForm(model.status?.snapshot_consistency ?? ''),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Take snapshot' })],
    focusNodeSelector: 'input'
  });
  const form = result.value;
  if (!result.button.accept || !form) {
    return;
  }
  await attempt(() => api.takeSnapshot(form.name, form.note));
  await model.refresh();
}

/**
 * Delete a snapshot: the one named, or one the user picks. Not with this server's token (anyone
 * with a terminal here can read it): on the workstations page, in a new tab, where the owner's
 * own login confirms it.
 */
export async function deleteSnapshot(model: WorkstationModel, name?: string): Promise<void> {
  const info = ready(model);
  if (!info) {
    return;
  }
  if (!name) {
    name = await pickSnapshot(model, 'Delete which snapshot?', false);
    if (!name) {
      return;
    }
  }
  // back here, the list shows what was done there
  window.addEventListener('focus', () => void model.refresh(), { once: true });
  window.open(`${info.service_page}?delete=${encodeURIComponent(name)}`, '_blank');
}

/** Restore a snapshot: the one named, or one the user picks. */
export async function restore(model: WorkstationModel, name?: string): Promise<void> {
  const info = ready(model);
  if (!info) {
    return;
  }
  if (!name) {
    name = await pickSnapshot(model, 'Restore which snapshot?', true);
    if (!name) {
      return;
    }
  }
  const result = await showDialog({
    title: `Restore snapshot ${name}?`,
    body:
      'The workstation will reboot: it stops, its disks are put back as they were in the snapshot, and it ' +
      'starts again. Unsaved work in running kernels is lost. A snapshot of the current state is taken first.',
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Restore and reboot' })]
  });
  if (!result.button.accept) {
    return;
  }
  if (!(await attempt(() => api.restore(name)))) {
    return;
  }
  await follow(model, info, `Restoring ${name}. You will be taken back here when the workstation is up again.`);
}

export async function reset(model: WorkstationModel): Promise<void> {
  const info = ready(model);
  if (!info) {
    return;
  }
  const expected = workstationName(info);
  const image = model.status?.golden_image.configured ?? 'the golden image';
  const workspace = model.status?.disks.workspace
    ? 'The workspace disk (/home) is kept as it is.'
    : 'This workstation has no workspace disk: /home is on the system disk and is replaced too.';
  const result = await showDialog({
    title: 'Reset the system?',
    body: new TypedConfirmation(
      [
        `The system disk is replaced by a fresh copy of ${image}: everything installed or changed outside ` +
          '/home (in /opt, /usr/local, /etc, system packages) is gone.',
        workspace,
        'A snapshot of the current state is taken first, so you can restore it. The workstation reboots; ' +
          'unsaved work in running kernels is lost.'
      ],
      expected
    ),
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Reset system' })],
    focusNodeSelector: 'input'
  });
  if (!result.button.accept) {
    return;
  }
  if (result.value !== expected) {
    await showErrorMessage(TITLE, `You typed "${result.value ?? ''}", not "${expected}": nothing was changed.`);
    return;
  }
  if (!(await attempt(() => api.reset(expected)))) {
    return;
  }
  await follow(model, info, 'Resetting the system. You will be taken back here when the workstation is up again.');
}

export async function stop(model: WorkstationModel): Promise<void> {
  const info = ready(model);
  if (!info) {
    return;
  }
  const result = await showDialog({
    title: 'Stop the workstation?',
    body:
      'Its CPUs, memory and GPUs are released; all disks are kept, and the next start brings the same ' +
      'machine back. Running kernels and programs end: unsaved work in them is lost.',
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop workstation' })]
  });
  if (!result.button.accept) {
    return;
  }
  await stopConfirmed(info);
}

/** "Stop now" in a drain's warning: the user chose it there, so no second question. */
export async function stopNow(model: WorkstationModel): Promise<void> {
  const info = ready(model);
  if (info) {
    await stopConfirmed(info);
  }
}

async function stopConfirmed(info: IInfo): Promise<void> {
  if (!(await attempt(() => api.stop()))) {
    return;
  }
  const steps = new StepList('Stopping the workstation.');
  steps.setSteps(['the Jupyter server ends', 'the machine shuts down', 'CPUs, memory and GPUs are released'], 1);
  void new Dialog({ title: TITLE, body: steps, buttons: [] }).launch();
  window.setTimeout(() => leave(info, 'stop'), 1500);
}

function leave(info: IInfo, follow: 'lab' | 'stop'): void {
  window.location.assign(`${info.service_page}?follow=${follow}`);
}

/** Show the operation's steps while this page can, then go to the service's page, which follows
 * it to the end and brings the user back into JupyterLab. */
async function follow(model: WorkstationModel, info: IInfo, intro: string): Promise<void> {
  const steps = new StepList(intro);
  const dialog = new Dialog({
    title: TITLE,
    body: steps,
    buttons: [Dialog.okButton({ label: 'Follow on the workstation page' })]
  });
  dialog
    .launch()
    .then(result => {
      if (result.button.accept) {
        leave(info, 'lab');
      }
    })
    .catch(() => undefined); // disposed: the operation failed, which is shown instead
  for (;;) {
    let status;
    try {
      status = await api.status();
    } catch (error) {
      break; // this server is going away: the machine is stopping
    }
    const op = status.operation;
    if (!op || op.state !== 'running') {
      if (op?.state === 'failed') {
        dialog.dispose();
        await showErrorMessage(TITLE, `The ${op.kind} failed: ${op.error ?? 'see the workstation page'}`);
        await model.refresh();
        return;
      }
      break;
    }
    steps.setSteps(op.step_labels, op.step);
    if (op.step_name !== 'snapshot') {
      break; // from here on the machine stops
    }
    await new Promise(resolve => window.setTimeout(resolve, 1000));
  }
  leave(info, 'lab');
}

/** How long "Keep running" keeps the workstation up: an hour, or the service's cap when lower. */
export function keepRunningMinutes(model: WorkstationModel): number {
  return Math.min(60, model.status?.keepalive_max_minutes ?? 60);
}

export async function keepRunning(model: WorkstationModel): Promise<void> {
  if (!ready(model)) {
    return;
  }
  if (!(await attempt(() => api.keepalive(keepRunningMinutes(model))))) {
    return;
  }
  // the new deadline now, even in a tab in the background (where the poll stands by)
  await model.refreshStatus().catch(() => model.refresh());
}

/**
 * The warning before an idle stop, with "Keep running": shown from warn_at until the deadline
 * moves on, its time left updated as it runs down.
 */
export class IdleWarning {
  constructor(private readonly model: WorkstationModel) {
    model.changed.connect(this._fetched, this);
    // The time to warn comes while nothing is fetched (a tab in the background polls nothing):
    // the last known deadline is checked every second.
    this._timer = window.setInterval(() => void this._tick(), 1000);
    document.addEventListener('visibilitychange', this._onVisible);
  }

  get isDisposed(): boolean {
    return this._timer === 0;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearInterval(this._timer);
    this._timer = 0;
    document.removeEventListener('visibilitychange', this._onVisible);
    this.model.changed.disconnect(this._fetched, this);
    this._dismiss();
  }

  private _fetched(): void {
    this._show();
  }

  /** Back to the tab with a warning shown: whether it still holds. */
  private _onVisible = (): void => {
    if (document.visibilityState === 'visible' && this._toast.shown) {
      void this._check();
    }
  };

  private async _check(): Promise<void> {
    if (this._checking) {
      return;
    }
    this._checking = true;
    try {
      await this.model.refreshStatus();
    } catch {
      this._unansweredAt = Date.now(); // the service does not answer: go by what is known
    } finally {
      this._checking = false;
    }
  }

  private async _tick(): Promise<void> {
    const idle = this.model.status?.idle;
    if (idle && Date.now() >= Date.parse(idle.warn_at) && !this._holds(idle.warn_at)) {
      // Due by a deadline fetched before its warning time: SSH, the GPU or a kernel may have moved it.
      await this._check();
    }
    this._show();
  }

  /** Whether the known deadline was still the deadline at its warning time. */
  private _holds(warnAt: string): boolean {
    return Math.max(this.model.statusAt, this._unansweredAt) >= Date.parse(warnAt);
  }

  private _show(): void {
    const idle = this.model.status?.idle;
    if (!idle || Date.now() < Date.parse(idle.warn_at) || !this._holds(idle.warn_at)) {
      this._dismiss();
      return;
    }
    const message = `This workstation has been idle: it will be stopped ${timeLeft(idle.deadline)} (its disks are kept).`;
    const minutes = keepRunningMinutes(this.model);
    this._toast.show(idle.deadline, message, {
      label: 'Keep running',
      caption: `Keep the workstation running for ${minutes} more minutes`,
      displayType: 'accent',
      callback: () => void keepRunning(this.model)
    });
  }

  private _dismiss(): void {
    this._toast.dismiss();
  }

  private _timer: number;
  private _checking = false;
  private _unansweredAt = 0;
  private _toast = new DeadlineToast();
}

/**
 * The warning of a drain of the node the workstation runs on, with "Stop now": shown while the
 * service reports the drain, its time left updated as it runs down. The deadline does not move:
 * an admin drains the node whatever happens on the machine.
 */
export class DrainWarning {
  constructor(private readonly model: WorkstationModel) {
    model.changed.connect(this._show, this);
    this._timer = window.setInterval(() => this._show(), 1000);
  }

  get isDisposed(): boolean {
    return this._timer === 0;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearInterval(this._timer);
    this._timer = 0;
    this.model.changed.disconnect(this._show, this);
    this._dismiss();
  }

  private _show(): void {
    const drain = this.model.status?.drain;
    if (!drain) {
      this._dismiss();
      return;
    }
    const why = drain.reason ? ` (${drain.reason})` : '';
    // (a toast shows 140 characters: the panel says the rest)
    const message = `This workstation's node is being drained${why}: it will be stopped ${timeLeft(drain.deadline)}. Save your work.`;
    this._toast.show(drain.deadline, message, {
      label: 'Stop now',
      caption: 'Stop the workstation now, before the drain does (save your work first)',
      displayType: 'warn',
      callback: () => void stopNow(this.model)
    });
  }

  private _dismiss(): void {
    this._toast.dismiss();
  }

  private _timer: number;
  private _toast = new DeadlineToast();
}

/** One notification about a deadline: shown, its text updated as the time left runs down, withdrawn. */
class DeadlineToast {
  get shown(): boolean {
    return this._id !== null;
  }

  show(deadline: string, message: string, action: Notification.IAction): void {
    if (this._id && this._deadline === deadline) {
      if (message !== this._message) {
        Notification.update({ id: this._id, message });
        this._message = message;
      }
      return;
    }
    this.dismiss();
    this._deadline = deadline;
    this._message = message;
    this._id = Notification.warning(message, { autoClose: false, actions: [action] });
  }

  dismiss(): void {
    if (this._id) {
      Notification.dismiss(this._id);
    }
    this._id = null;
    this._deadline = null;
    this._message = '';
  }

  private _id: string | null = null;
  private _deadline: string | null = null;
  private _message = '';
}
