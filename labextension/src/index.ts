// kubevirt-spawner's JupyterLab extension: the Workstation panel, its status bar item and commands.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
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

// VS Code's tile: a plain editor glyph (the product's own logo is Microsoft's mark)
const VSCODE_ICON = new LabIcon({
  name: 'kubevirt-spawner:vscode',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon-brand0" fill="#0065A9">' +
    '<path d="M3 3h18a1 1 0 0 1 1 1v16a1 1 0 0 1-1 1H3a1 1 0 0 1-1-1V4a1 1 0 0 1 1-1zm1 4v12h16V7z"/>' +
    '<path d="M9.3 9.3 5.6 13l3.7 3.7 1.4-1.4L8.4 13l2.3-2.3zm5.4 0-1.4 1.4 2.3 2.3-2.3 2.3 1.4 1.4 3.7-3.7z"/>' +
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
  sshKeys: 'workstation:ssh-keys',
  vscode: 'workstation:vscode'
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
  optional: [IStatusBar, ILauncher],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette,
    statusBar: IStatusBar | null,
    launcher: ILauncher | null
  ) => {
    const model = new WorkstationModel();
    new actions.IdleWarning(model);
    new actions.DrainWarning(model);
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
    // VS Code in the browser, where this server offers it (the guest's `vscode/`): a new tab
    commands.addCommand(COMMANDS.vscode, {
      label: 'VS Code',
      caption: 'Open VS Code in the browser on this workstation (a new tab)',
      icon: VSCODE_ICON,
      isEnabled: () => !!model.info?.vscode_url,
      execute: () => window.open(model.info?.vscode_url, '_blank')
    });
    for (const command of Object.values(COMMANDS)) {
      palette.addItem({ command, category: CATEGORY });
    }
    if (launcher) {
      // the tile appears once the server has said it offers VS Code
      const addTile = () => {
        if (model.info?.vscode_url) {
          launcher.add({ command: COMMANDS.vscode, category: 'Notebook', rank: 50 });
          model.changed.disconnect(addTile);
        }
      };
      model.changed.connect(addTile);
      addTile();
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
