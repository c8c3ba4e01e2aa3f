// kubevirt-spawner's JupyterLab extension: the Workstation panel, its status bar item and commands.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import * as actions from './actions';
import { WorkstationModel, timeLeft } from './model';
import { WorkstationPanel } from './panel';

const ICON = new LabIcon({
  name: 'kubevirt-spawner:workstation',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<path d="M3 4h18a1 1 0 0 1 1 1v11a1 1 0 0 1-1 1h-7v2h3v2H7v-2h3v-2H3a1 1 0 0 1-1-1V5a1 1 0 0 1 1-1zm1 2v9h16V6z"/>' +
    '</g></svg>'
});

const CATEGORY = 'Workstation';
const COMMANDS = {
  open: 'workstation:open',
  snapshot: 'workstation:take-snapshot',
  restore: 'workstation:restore',
  delete: 'workstation:delete-snapshot',
  reset: 'workstation:reset',
  stop: 'workstation:stop',
  keep: 'workstation:keep-running',
  refresh: 'workstation:refresh',
  page: 'workstation:open-service-page',
  sshKeys: 'workstation:ssh-keys'
};

/** Root disk use and, when idle stops are configured, the time left before one. */
class StatusItem extends Widget {
  constructor(private readonly model: WorkstationModel, onClick: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('kvs-status');
    this.node.setAttribute('type', 'button');
    this.node.addEventListener('click', onClick);
    model.changed.connect(this.render, this);
    this.render();
  }

  render(): void {
    const status = this.model.status;
    const root = status?.disks.root;
    const parts = [];
    if (root && root.percent !== null) {
      parts.push(`Disk ${Math.round(root.percent)} %`);
    }
    if (status?.idle) {
      parts.push(`idle stop ${timeLeft(status.idle.deadline)}`);
    }
    this.node.textContent = parts.join(' · ');
    this.node.className = `kvs-status kvs-level-${root?.level ?? 'unknown'}`;
    this.node.title = 'Workstation: open the panel';
    this.setHidden(parts.length === 0);
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: '@kubevirt-spawner/workstation:plugin',
  description: 'The Workstation panel: snapshots, restore, reset, stop, disk and idle status.',
  autoStart: true,
  requires: [ICommandPalette],
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, palette: ICommandPalette, statusBar: IStatusBar | null) => {
    const model = new WorkstationModel();
    new actions.IdleWarning(model);
    const panel = new WorkstationPanel(model);
    panel.title.icon = ICON;
    app.shell.add(panel, 'left', { rank: 950 });

    const { commands } = app;
    commands.addCommand(COMMANDS.open, {
      label: 'Open the Workstation panel',
      execute: () => app.shell.activateById(panel.id)
    });
    commands.addCommand(COMMANDS.snapshot, {
      label: 'Take a snapshot of this workstation',
      execute: () => actions.takeSnapshot(model)
    });
    commands.addCommand(COMMANDS.restore, {
      label: 'Restore a snapshot of this workstation…',
      execute: () => actions.restore(model)
    });
    commands.addCommand(COMMANDS.delete, {
      label: 'Delete a snapshot of this workstation…',
      execute: () => actions.deleteSnapshot(model)
    });
    commands.addCommand(COMMANDS.reset, {
      label: 'Reset the system to the golden image…',
      execute: () => actions.reset(model)
    });
    commands.addCommand(COMMANDS.stop, { label: 'Stop this workstation…', execute: () => actions.stop(model) });
    commands.addCommand(COMMANDS.keep, {
      label: () => `Keep this workstation running (${actions.keepRunningMinutes(model)} min)`,
      execute: () => actions.keepRunning(model)
    });
    commands.addCommand(COMMANDS.refresh, { label: 'Refresh the workstation status', execute: () => model.refresh() });
    commands.addCommand(COMMANDS.page, {
      label: 'Open the workstation page (rescue page)',
      isEnabled: () => !!model.info?.configured,
      execute: () => window.open(model.info?.service_page, '_blank')
    });
    commands.addCommand(COMMANDS.sshKeys, {
      label: 'Manage your SSH keys (all your workstations)',
      isEnabled: () => !!model.info?.configured,
      execute: () => window.open(model.info?.ssh_keys_page, '_blank')
    });
    for (const command of Object.values(COMMANDS)) {
      palette.addItem({ command, category: CATEGORY });
    }

    if (statusBar) {
      const item = new StatusItem(model, () => app.shell.activateById(panel.id));
      statusBar.registerStatusItem('@kubevirt-spawner/workstation:status', {
        item,
        align: 'left',
        rank: 50,
        isActive: () => true
      });
    }
  }
};

export default plugin;
